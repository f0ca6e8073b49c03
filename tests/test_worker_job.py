"""WorkerJob: the one typed document between the coordinator and its node workers."""

from __future__ import annotations

import json

import pytest

from coordinator.config import EngineConfig
from coordinator.cpu_experts import plan_cpu_experts, pool_nodes, worker_job
from coordinator.model.source import open_source
from coordinator.model.weights import load_weights
from node_worker.job import JobError, WorkerJob, max_message_bytes


@pytest.fixture
def job(tiny_model) -> WorkerJob:
    model = tiny_model()
    cfg = EngineConfig(pool="process", numa_split=True, nodes=2, pool_spin_us=5.0, keep_shm=True,
                       worker_log_level="INFO", worker_threads=1)
    source = open_source(model)
    cpu = plan_cpu_experts(source, cfg, load_weights(source.config, source.checkpoint).experts, pool_nodes(cfg))
    return worker_job(source, cpu, cfg, 128)


def test_round_trip_is_equal_and_carries_the_settings(job):
    back = WorkerJob.from_json(job.to_json())
    assert back == job
    assert (back.spin_us, back.keep_shm, back.log_level) == (5.0, True, "INFO")
    assert [n.node for n in back.nodes] == [0, 1] and all(n.threads == 1 for n in back.nodes)
    assert back.max_message_bytes == max_message_bytes(128, back.hidden)
    refs, inter = back.expert_map()[(back.moe_layers[0], 0)]
    assert inter == back.intermediate and refs == job.experts[0].refs


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.pop("hidden"), "hidden"),
    (lambda d: d.update(hidden="64"), "'hidden' must be int"),
    (lambda d: d.update(keep_shm=1), "'keep_shm' must be bool"),
    (lambda d: d.update(moe_layers=[0, "1"]), "'moe_layers' must be a list of integers"),
    (lambda d: d["nodes"][0].update(cpus="0,1"), "'cpus' must be list"),
    (lambda d: d["experts"][0].update(refs={"gate": {}}), "refs"),
    (lambda d: d["experts"].append(7), "expert entry must be an object"),
])
def test_a_broken_job_names_the_field(job, edit, named):
    doc = json.loads(job.to_json())
    edit(doc)
    with pytest.raises(JobError, match=named):
        WorkerJob.from_json(json.dumps(doc))


def test_a_node_outside_the_job_is_refused(job):
    with pytest.raises(JobError, match="node 5 is not in this job"):
        job.node(5)
