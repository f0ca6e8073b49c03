"""Request latencies as Prometheus histograms, named and bucketed as vLLM's /metrics has them.

    queue        arrival -> the first prefill step            vllm:request_queue_time_seconds
    first token  arrival -> the first token chosen            vllm:time_to_first_token_seconds
    inter-token  between one token and the next of a request  vllm:inter_token_latency_seconds
    end to end   arrival -> the request's end                 vllm:e2e_request_latency_seconds

The scheduler observes them (its clock: time.monotonic); the server's stats carry them to the HTTP
frontend, which writes them with the served model's name as the ``model_name`` label, so dashboards made for
vLLM read them unchanged.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets, seconds
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]  # upper bounds, ascending; +Inf is implied
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last: above every bound
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}


# (stats key, vLLM's metric name, help, buckets)
METRICS = (
    ("queue", "vllm:request_queue_time_seconds", "time requests waited before their first prefill step",
     REQUEST_BUCKETS),
    ("first_token", "vllm:time_to_first_token_seconds", "time from a request's arrival to its first token",
     FIRST_TOKEN_BUCKETS),
    ("inter_token", "vllm:inter_token_latency_seconds", "time between a request's consecutive tokens",
     INTER_TOKEN_BUCKETS),
    ("end_to_end", "vllm:e2e_request_latency_seconds", "time from a request's arrival to its end",
     REQUEST_BUCKETS),
)


def new_histograms() -> dict[str, Histogram]:
    return {key: Histogram(buckets) for key, _, _, buckets in METRICS}


def prometheus_lines(histograms: dict[str, dict], model: str) -> list[str]:
    """The histograms (Histogram.as_dict's) in Prometheus' text format, cumulative, labelled with the model."""
    lines = []
    label = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    for key, name, text, _ in METRICS:
        h = histograms.get(key)
        if h is None:
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip([*h["buckets"], "+Inf"], h["counts"]):
            running += count
            lines.append(f'{name}_bucket{{model_name="{label}",le="{bound}"}} {running}')
        lines += [f'{name}_sum{{model_name="{label}"}} {h["sum"]}', f'{name}_count{{model_name="{label}"}} {running}']
    return lines
