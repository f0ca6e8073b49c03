"""The ``strata`` command line: in-process through cli.main, and once through ``python -m coordinator``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.main import main
from coordinator.cli.make_model import EOS_ID
from coordinator.config import ENV_VARS

REPO = Path(__file__).resolve().parents[1]
N = 12


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No STRATA_* variable of the caller's shell leaks into a test."""
    for var, _ in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    assert main(["make-model", "--out", str(out), "--seed", "0"]) == 0
    return out


def run_json(capsys, *args):
    capsys.readouterr()
    rc = main(["generate", *args, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out  # exactly one JSON object on stdout
    return json.loads(lines[0]), err


def check_length(doc, n):
    ids = doc["ids"]
    if doc["finish_reason"] == "eos":
        assert 0 < len(ids) <= n and ids[-1] == EOS_ID
    else:
        assert doc["finish_reason"] == "length"
        assert len(ids) == n


# -- make-model -------------------------------------------------------------


def test_make_model_writes_a_checkpoint_dir(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--out", str(out), "--seed", "3", "--arch", "mixtral"]) == 0
    assert str(out) in capsys.readouterr().out
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    with Engine.open(out) as engine:
        assert engine.model_config.arch == "mixtral"


def test_make_model_is_deterministic(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert main(["make-model", "--out", str(tmp_path / name), "--seed", str(seed)]) == 0
    a, b, c = ((tmp_path / n / "model.safetensors").read_bytes() for n in "abc")
    assert a == b
    assert a != c and len(a) == len(c)
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "c" / "config.json").read_bytes()


@pytest.mark.slow
def test_make_model_subprocess_matches_in_process(tmp_path):
    """The real entry point (python -m coordinator) writes the same bytes as cli.main."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "make-model", "--out", str(tmp_path / "sub"), "--seed", "11",
         "--dtype", "BF16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny qwen3_moe model (seed 11, BF16)" in proc.stdout
    assert main(["make-model", "--out", str(tmp_path / "inproc"), "--seed", "11", "--dtype", "BF16"]) == 0
    assert (tmp_path / "sub" / "model.safetensors").read_bytes() == \
        (tmp_path / "inproc" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_subprocess_error_exit_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "generate", "--model", str(missing), "--prompt-ids", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and proc.stdout == ""


# -- generate ---------------------------------------------------------------


def test_generate_json_matches_engine(model, capsys):
    doc, err = run_json(capsys, "--model", str(model), "--prompt", "Hello", "--max-new-tokens", str(N))
    assert "pool process" in err  # the pool line goes to stderr, not into the JSON (the CLI runs node workers)
    check_length(doc, N)
    with Engine.open(model, EngineConfig()) as engine:
        prompt = engine.encode("Hello")
        assert doc["prompt_ids"] == prompt
        assert doc["ids"] == engine.generate(prompt, N)
        assert doc["text"] == engine.decode(doc["ids"])
    assert doc["pool"]["nodes"] == [0] and doc["pool"]["numa_split"] is False
    assert doc["timing"]["prefill_tokens"] == len(prompt)


def test_generate_prompt_ids(model, capsys):
    doc, _ = run_json(capsys, "--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert doc["prompt_ids"] == [1, 2, 3]
    check_length(doc, 5)
    with Engine.open(model) as engine:
        assert doc["ids"] == engine.generate([1, 2, 3], 5)


def test_streaming_text_is_the_decoded_ids(model, capsys):
    doc, _ = run_json(capsys, "--model", str(model), "--prompt", "Hello", "--max-new-tokens", str(N))
    assert main(["generate", "--model", str(model), "--prompt", "Hello", "--max-new-tokens", str(N)]) == 0
    out = capsys.readouterr().out
    assert doc["text"]  # something to compare
    assert out == doc["text"] + "\n"


def sampled_ids(capsys, model, seed):
    doc, _ = run_json(capsys, "--model", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "16",
                      "--temperature", "0.8", "--seed", str(seed))
    return doc["ids"]


def test_sampling_is_reproducible_by_seed(model, capsys):
    first, again = sampled_ids(capsys, model, 5), sampled_ids(capsys, model, 5)
    assert first == again
    assert sampled_ids(capsys, model, 6) != first
    with Engine.open(model) as engine:
        assert engine.generate([5, 6, 7], 16, 0.8, seed=5) == first


def test_bad_prompt_ids_exit_2(model, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--prompt-ids", "x,y"]) == 2
    out, err = capsys.readouterr()
    assert "--prompt-ids 'x,y': expected comma-separated integers" in err
    assert out == ""


def test_missing_model_dir_exit_2(tmp_path, capsys):
    missing = tmp_path / "absent"
    assert main(["generate", "--model", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata: error:") and str(missing) in err


@pytest.mark.slow
def test_numa_split_over_two_nodes_gives_the_same_ids(model, capsys):
    args = ["--model", str(model), "--prompt", "Hello", "--max-new-tokens", str(N)]
    whole, _ = run_json(capsys, *args)
    split, err = run_json(capsys, *args, "--numa-split", "--nodes", "2")
    assert "split by rows" in err
    assert split["pool"]["nodes"] == [0, 1]
    assert split["pool"]["numa_split"] is True
    assert split["pool"]["plan"] != whole["pool"]["plan"]
    assert split["ids"] == whole["ids"]
    assert split["text"] == whole["text"]


# -- config ---------------------------------------------------------------------


def config_line(capsys, *args, field="numa_split"):
    capsys.readouterr()
    assert main(["config", *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] == field]
    assert len(lines) == 1
    return lines[0]


def test_config_default(capsys):
    line = config_line(capsys)
    assert line.split()[1] == "False"
    assert "(default; variable STRATA_NUMA_SPLIT)" in line


def test_config_from_env(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_NUMA_SPLIT", "1")
    line = config_line(capsys)
    assert line.split()[1] == "True"
    assert "(env STRATA_NUMA_SPLIT;" in line


def test_config_flag_beats_env(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_NUMA_SPLIT", "0")
    assert config_line(capsys).split()[1] == "False"
    line = config_line(capsys, "--numa-split")
    assert line.split()[1] == "True"
    assert "(flag;" in line


def test_config_bad_env_value_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_NUMA_SPLIT", "maybe")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "STRATA_NUMA_SPLIT='maybe'" in err


def test_generate_print_config_uses_env(model, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_NODES", "2")
    monkeypatch.setenv("STRATA_NUMA_SPLIT", "yes")
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--prompt-ids", "1", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["nodes", "2"] and "env STRATA_NODES" in line for line in out.splitlines())


def test_shm_clean_all_removes_pool_folders_of_gone_coordinators_only(tmp_path, monkeypatch, capsys, dev_shm_alone):
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from coordinator.cli.main import main
    from shm.segments import process_start_time

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_start = process_start_time(gone.pid) or 0.0
    gone.wait()
    for name, owner in (("strata-pool-dead", {"pid": gone.pid, "start": gone_start}),
                        ("strata-pool-live", {"pid": os.getpid(), "start": process_start_time(os.getpid())})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner.json").write_text(json.dumps(owner))
    main(["shm", "clean", "--all"])
    out = capsys.readouterr().out
    assert not (tmp_path / "strata-pool-dead").exists() and "strata-pool-dead: removed" in out
    assert (tmp_path / "strata-pool-live").exists() and "strata-pool-live" not in out


THREAD_VARS = ("OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
ENTRY_POINTS = {  # each entry point run in a fresh interpreter as far as its arguments take it
    "strata": "from coordinator.cli.entry import main\nsys.argv = ['strata', 'config']\nmain()\n",
    "kernel compile": "import runpy\nsys.argv = ['warmup', '--help']\ntry:\n"
                      "    runpy.run_module('coordinator.warmup', run_name='__main__')\nexcept SystemExit:\n    pass\n",
    "node worker": "import runpy\nsys.argv = ['node_worker', '--help']\ntry:\n"
                   "    runpy.run_module('node_worker', run_name='__main__')\nexcept SystemExit:\n    pass\n",
}


def thread_settings(code: str, given: dict[str, str]) -> dict:
    """The thread variables (THREAD_VARS) when NumPy was first imported and after ``code``, in a fresh
    interpreter whose environment has ``given`` of them."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    spy = ("import builtins, json, os, sys\n"
           "real, seen = builtins.__import__, []\n"
           "def spy(name, *args, **kwargs):\n"
           "    if name.split('.')[0] == 'numpy' and not seen:\n"
           f"        seen.append({{v: os.environ.get(v) for v in {THREAD_VARS!r}}})\n"
           "    return real(name, *args, **kwargs)\n"
           "builtins.__import__ = spy\n")
    after = ("print(json.dumps({'numpy': seen[0] if seen else None, "
             f"'after': {{v: os.environ.get(v) for v in {THREAD_VARS!r}}}}}))\n")
    out = subprocess.run([sys.executable, "-c", spy + code + after], cwd=REPO, env=dict(env, **given),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("given, expected", [({}, {"OPENBLAS_THREAD_TIMEOUT": "4", "GOMP_SPINCOUNT": "10000"}),
                                             ({"OPENBLAS_THREAD_TIMEOUT": "12", "OMP_WAIT_POLICY": "PASSIVE"},
                                              {"OPENBLAS_THREAD_TIMEOUT": "12", "GOMP_SPINCOUNT": None})],
                         ids=["default", "user's"])
@pytest.mark.slow
def test_every_entry_point_sets_the_thread_variables_before_numpy_unless_the_user_did(entry, given, expected):
    """OpenBLAS's idle threads sleep at once and libgomp's spin a while (shm/threads_env.py), set by each entry
    point before NumPy loads OpenBLAS; a choice of the user's stays."""
    got = thread_settings(ENTRY_POINTS[entry], given)
    want = {"OMP_WAIT_POLICY": given.get("OMP_WAIT_POLICY"), **expected}
    assert got["numpy"] == got["after"] == want


def test_importing_the_packages_sets_no_thread_variable():
    got = thread_settings("import coordinator.engine, coordinator.cli.main, node_worker.kernel_threads\n", {})
    assert got["numpy"] == got["after"] == {v: None for v in THREAD_VARS}
