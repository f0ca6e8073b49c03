#!/usr/bin/env python
"""Bounded load-and-fault run of ``strata serve`` on loopback.

    .venv/bin/python tools/soak.py [--clients 16] [--minutes 5] [--nodes 2] [--fault-every 8] [--json out.json]

It starts ``strata serve`` with the process pool split over ``--nodes``
(virtual) nodes, records the greedy text of every prompt in an undisturbed run,
then lets ``--clients`` clients send requests for ``--minutes`` while a fault
thread, every ``--fault-every`` seconds on average, SIGKILLs a random node
worker or SIGSTOPs one for a while (past the hang deadline or not) and
resumes it. At the end it reports the requests sent, completed, errored (the
server answered with an error) and lost (no answer: a client timed out or its
connection dropped), checks every completed text against the undisturbed run,
stops the server with SIGTERM and checks that no worker process and no
segment is left. Exit status 0 when nothing was lost, nothing differed and
nothing was left behind.

Every request loop is bounded by the run's end time; traffic goes only to
the loopback server it started.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.cli.make_model import make_model  # noqa: E402
from coordinator.serving.client import Client, RequestFailed, ServerDisconnected, ServerTimeout  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox", "abc", "zz top", "1234567", "a", "Once upon a time, there was", "MoE!",
           "Numbers: 1, 2, 3", "x" * 40, "Split the experts by rows", "two sockets, one GPU"]
MAX_NEW = 48
ERROR_BACKOFF_S = 0.5


def start_server(model: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "coordinator", "serve", "--model", str(model), "--bind", "tcp://127.0.0.1:*",
           "--pool", "process", "--numa-split", "--nodes", str(args.nodes), "--max-active", str(args.clients),
           "--worker-hang-timeout", str(args.hang_timeout), "--worker-restart-window", str(args.restart_window)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True).start()
    line = lines.get(timeout=300)
    if not line or not line.startswith("serving on "):
        proc.kill()
        raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}")
    return proc, line.split("serving on ", 1)[1].strip()


def reference_ids(address: str) -> dict[str, list[int]]:
    """The undisturbed run: each prompt's greedy ids, MAX_NEW tokens (or up to eos)."""
    out = {}
    with Client(address, timeout=120) as c:
        for p in PROMPTS:
            gen = c.generate(p, max_new_tokens=MAX_NEW, stream=False)
            list(gen)
            out[p] = gen.final["ids"]
    return out


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()
        self.lost: list[str] = []
        self.mismatches: list[dict] = []
        self.error_samples: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n


def client_loop(address: str, refs: dict, end: float, seed: int, tally: Tally, timeout: float) -> None:
    rng = random.Random(seed)
    c = Client(address, timeout=timeout)
    try:
        while time.monotonic() < end:
            prompt, n, stream = rng.choice(PROMPTS), rng.randint(4, MAX_NEW), rng.random() < 0.5
            tally.add("sent")
            try:
                gen = c.generate(prompt, max_new_tokens=n, stream=stream)
                list(gen)
            except RequestFailed as exc:
                with tally.lock:
                    tally.counts["errored"] += 1
                    tally.errors[exc.code] += 1
                    tally.error_samples.setdefault(exc.message[:160], 0)
                    tally.error_samples[exc.message[:160]] += 1
                time.sleep(ERROR_BACKOFF_S)  # as a real client would, rather than hammer a server that refused
                continue
            except (ServerTimeout, ServerDisconnected) as exc:
                with tally.lock:
                    tally.counts["lost"] += 1
                    tally.lost.append(f"{type(exc).__name__}: {exc}")
                c.close()
                c = Client(address, timeout=timeout)
                continue
            tally.add("completed")
            want = refs[prompt][:n]
            if gen.final["ids"] != want:
                with tally.lock:
                    tally.mismatches.append({"prompt": prompt, "n": n, "got": gen.final["ids"], "want": want})
    finally:
        c.close()


def fault_loop(address: str, end: float, args, rng: random.Random, tally: Tally, stop: threading.Event) -> None:
    """SIGKILL or SIGSTOP (then SIGCONT) a random worker, at random intervals."""
    while not stop.wait(rng.expovariate(1.0 / args.fault_every)):
        if time.monotonic() > end - args.fault_every:
            return
        try:
            with Client(address, timeout=10) as c:
                nodes = [n for n in c.health()["pool"]["nodes"] if n["alive"]]
        except Exception as exc:
            tally.add("health_failures")
            print(f"health failed during the run: {exc}", file=sys.stderr)
            continue
        if not nodes:
            continue
        pid = rng.choice(nodes)["pid"]
        try:
            if rng.random() < 0.5:
                os.kill(pid, signal.SIGKILL)
                tally.add("sigkills")
            else:
                pause = rng.uniform(0.2, 2 * args.hang_timeout)
                os.kill(pid, signal.SIGSTOP)
                tally.add("sigstops")
                tally.add("sigstops_past_deadline" if pause > args.hang_timeout else "sigstops_short")
                stop.wait(pause)
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model folder (default: a tiny model made in a temporary folder)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--fault-every", dest="fault_every", type=float, default=8.0, help="mean seconds between faults")
    ap.add_argument("--hang-timeout", dest="hang_timeout", type=float, default=2.0,
                    help="the server's --worker-hang-timeout")
    ap.add_argument("--restart-window", dest="restart_window", type=float, default=5.0,
                    help="the server's --worker-restart-window")
    ap.add_argument("--client-timeout", dest="client_timeout", type=float, default=60.0,
                    help="a request unanswered this long counts as lost")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="strata-soak-"))
    model = args.model or make_model(tmp / "model", seed=0)
    proc, address = start_server(model, args, tmp / "serve.err")
    tally = Tally()
    try:
        refs = reference_ids(address)
        with Client(address, timeout=10) as c:
            pids = [n["pid"] for n in c.health()["pool"]["nodes"]]
            segments = [n["segment"] for n in c.health()["pool"]["nodes"]]
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        stop = threading.Event()
        threads = [threading.Thread(target=client_loop, args=(address, refs, end, args.seed * 1000 + i, tally,
                                                              args.client_timeout)) for i in range(args.clients)]
        faults = threading.Thread(target=fault_loop, args=(address, end, args, random.Random(args.seed), tally, stop))
        for t in threads + [faults]:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        faults.join()
        elapsed = time.monotonic() - t0
        with Client(address, timeout=30) as c:
            health, stats = c.health(), c.stats()
        all_pids = set(pids) | {n["pid"] for n in health["pool"]["nodes"]}
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                p.resume()
            except psutil.Error:
                pass
        t_stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed after 30 s"
        stop_s = time.monotonic() - t_stop
    left_procs = sorted(p for p in all_pids if psutil.pid_exists(p))
    left_segments = sorted(s for s in segments if s and Path("/dev/shm" + s).exists())
    c = tally.counts
    report = {
        "clients": args.clients, "minutes": round(elapsed / 60, 2), "nodes": f"{args.nodes} (virtual)",
        "sent": c["sent"], "completed": c["completed"], "errored": c["errored"], "lost": c["lost"],
        "error_codes": dict(tally.errors),
        "errors_while_a_restart_was_refused": sum(n for m, n in tally.error_samples.items()
                                                  if "died twice" in m or "restart failed" in m),
        "text_mismatches": len(tally.mismatches),
        "sigkills": c["sigkills"], "sigstops": c["sigstops"],
        "sigstops_past_hang_deadline": c["sigstops_past_deadline"], "health_failures": c["health_failures"],
        "worker_restarts": sum(n["restarts"] for n in health["pool"]["nodes"]),
        "worker_deaths": sum(n["deaths"] for n in health["pool"]["nodes"]),
        "tokens": stats["tokens"], "server_exit": code, "sigterm_to_exit_s": round(stop_s, 2),
        "processes_left": left_procs, "segments_left": left_segments,
        "error_messages": dict(sorted(tally.error_samples.items(), key=lambda kv: -kv[1])[:8]),
        "lost_detail": tally.lost[:10], "mismatch_detail": tally.mismatches[:5],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = (not c["lost"] and not tally.mismatches and not left_procs and not left_segments and code == 0
          and c["completed"] > 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
