"""Command-line mistakes caught before anything loads, and the habits of llama.cpp and vLLM users (issue 18).

Each refusal is checked against a model path that does not exist: had the
command started loading, the error would name the missing model instead of
the mistake, so the message itself shows nothing was loaded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli.main import build_parser, main
from coordinator.config import ENV_VARS


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var, _ in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)


def refused(capsys, *argv) -> str:
    """Run the command; it must exit 2 (argparse's usage error, or strata's); returns stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    out = capsys.readouterr()
    assert out.out == ""
    return out.err


@pytest.mark.parametrize("flags, named", [
    (["--temperature", "-1"], r"--temperature must be in [0.0, inf], got -1"),
    (["--temperature", "nan"], r"--temperature must be in [0.0, inf], got nan"),
    (["--top-p", "0"], r"--top-p must be in (0.0, 1.0], got 0"),
    (["--top-p", "1.5"], r"--top-p must be in (0.0, 1.0], got 1.5"),
    (["--top-k", "-3"], r"--top-k must be in [0, inf], got -3"),
    (["-n", "0"], r"--max-new-tokens must be in [1, inf], got 0"),
    (["--top-k", "two"], r"'two' is not an integer"),
    (["-t", "0"], r"--worker-threads must be in [1, inf], got 0"),
])
def test_sampling_mistakes_are_refused_before_the_model_loads(tmp_path, capsys, flags, named):
    err = refused(capsys, "generate", "--model", str(tmp_path / "absent"), "--prompt", "hi", *flags)
    assert named in err and "absent" not in err


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path, capsys):
    err = refused(capsys, "generate", "-m", str(tmp_path / "absent"), "-p", "")
    assert "--prompt is empty" in err and "absent" not in err
    err = refused(capsys, "client", "")
    assert "the prompt is empty" in err


def test_more_split_nodes_than_cpus_is_refused_with_the_limit_before_loading(tmp_path, capsys):
    cpus = len(os.sched_getaffinity(0))
    err = refused(capsys, "generate", "-m", str(tmp_path / "absent"), "-p", "hi", "--numa-split", "--nodes", "99")
    assert f"nodes 99: this process may use {cpus} CPUs, so a split runs at most {cpus} nodes" in err
    assert "absent" not in err  # the nodes were checked first: nothing was loaded, no worker started


def test_outputs_into_a_missing_folder_and_missing_inputs_are_refused_before_the_run(tmp_path, capsys):
    model = str(tmp_path / "absent")
    err = refused(capsys, "bench", "-m", model, "--json", str(tmp_path / "no" / "r.json"))
    assert f"folder {tmp_path / 'no'} does not exist" in err and "absent" not in err
    err = refused(capsys, "bench", "-m", model, "--plot", str(tmp_path))
    assert "is a folder; give a file name" in err
    err = refused(capsys, "profile", "-m", model, "--prompts", str(tmp_path / "missing.txt"), "--out", "p.json")
    assert "missing.txt: no such file" in err


def test_make_model_refuses_a_folder_with_files_and_force_replaces_it_whole(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--out", str(out), "--seed", "1", "--layers", "1"]) == 0
    (out / "stale-00009-of-00009.safetensors").write_bytes(b"old shard")
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    err = refused(capsys, "make-model", "--out", str(out), "--seed", "2", "--layers", "1")
    assert f"--out {out} is not an empty folder; pass --force" in err
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched
    assert main(["make-model", "--out", str(out), "--seed", "2", "--layers", "1", "--force"]) == 0
    assert not (out / "stale-00009-of-00009.safetensors").exists()  # replaced whole, no old shard left
    assert (out / "config.json").exists()


def test_version_short_flags_and_verbose_after_the_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("strata ")
    parser = build_parser()
    args = parser.parse_args(["generate", "-m", "M", "-p", "hi", "-n", "3", "-t", "2", "-v"])
    assert (str(args.model), args.prompt, args.max_new_tokens, args.worker_threads, args.verbose) == \
        ("M", "hi", 3, 2, True)
    assert parser.parse_args(["-v", "topo"]).verbose and parser.parse_args(["shm", "list", "-v"]).verbose
    assert not parser.parse_args(["topo"]).verbose
    args = parser.parse_args(["client", "hi", "--top-k", "5", "--top-p", "0.5", "-n", "7", "--stop", "a",
                              "--stop", "b"])
    assert (args.top_k, args.top_p, args.max_new_tokens, args.stop) == (5, 0.5, 7, ["a", "b"])  # generate's flags


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    assert main(["make-model", "--out", str(out), "--seed", "4", "--layers", "1"]) == 0
    return out


def test_ctrl_c_ends_the_line_and_exits_130_without_a_traceback(tiny, capsys, monkeypatch):
    from coordinator import engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.Engine, "open", interrupted)
    assert main(["generate", "-m", str(tiny), "-p", "hi"]) == 130
    out = capsys.readouterr()
    assert out.err == "\n" and out.out == ""


def test_prompt_ids_outside_the_vocabulary_or_the_context_are_refused_before_the_weights_load(tiny, capsys,
                                                                                               monkeypatch):
    from coordinator import engine

    def loaded(*args, **kwargs):
        raise AssertionError("the engine was opened")

    monkeypatch.setattr(engine.Engine, "open", loaded)
    err = refused(capsys, "generate", "-m", str(tiny), "--prompt-ids", "1,99999")
    assert "token id 99999 is outside the vocabulary [0, 320)" in err
    err = refused(capsys, "generate", "-m", str(tiny), "--prompt-ids", "1,2", "-n", "5000")
    assert "2 prompt tokens + 5000 new tokens exceed the maximum sequence length 4096" in err
    err = refused(capsys, "generate", "-m", str(tiny), "--prompt-ids", " , ")
    assert "--prompt-ids is empty" in err
    err = refused(capsys, "generate", "-m", str(tiny), "-p", "a" * 5000)  # byte-level: 5000 tokens
    assert "5000 prompt tokens + 256 new tokens exceed the maximum sequence length 4096" in err
    (tiny / "tokenizer.json").rename(tiny / "tokenizer.json.away")
    try:
        err = refused(capsys, "generate", "-m", str(tiny), "-p", "hello")
    finally:
        (tiny / "tokenizer.json.away").rename(tiny / "tokenizer.json")
    assert f"{tiny} has no tokenizer; pass token ids (--prompt-ids) instead of text" in err


def test_serve_on_a_port_in_use_is_refused_before_the_model_loads(tmp_path, capsys):
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        err = refused(capsys, "serve", "-m", str(tmp_path / "absent"), "--bind", f"tcp://127.0.0.1:{port}")
    finally:
        sock.close(linger=0)
    assert f"cannot bind tcp://127.0.0.1:{port}: Address already in use" in err and "absent" not in err


def test_generate_ends_with_a_speed_line_on_stderr(tiny, capsys):
    assert main(["generate", "-m", str(tiny), "--prompt-ids", "5,6,7", "-n", "4", "--pool", "inproc"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()  # the text on stdout, the speed line apart on stderr
    last = out.err.strip().splitlines()[-1]
    assert re.fullmatch(r"load \d+\.\d s( \(of which compiling kernels \d+\.\d s, first run\))? \| prompt: 3 tokens in "
                        r"\d+\.\d\d s \(\d+\.\d tok/s\) \| decode: 3 tokens in \d+\.\d\d s \(\d+\.\d tok/s\) \| time to "
                        r"first token \d+\.\d\d s", last), last
    assert main(["generate", "-m", str(tiny), "--prompt-ids", "5,6,7", "-n", "4", "--pool", "inproc", "--json"]) == 0
    timing = json.loads(capsys.readouterr().out)["timing"]
    assert timing["load_s"] > 0 and 0 <= timing["compile_s"] <= timing["load_s"]


def test_the_no_gpu_warning_comes_once_per_machine_state(tmp_path, monkeypatch, caplog, capsys):
    """A GPU that CuPy cannot use: one ``strata:`` line on stderr the first time, naming why; then INFO (-v only);
    a new reason says it again."""
    from coordinator.gpu import probe as backend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(backend, "nvidia_device_present", lambda: True)
    monkeypatch.setattr(backend, "probe_cuda", lambda: (False, "CuPy is not installed"))

    def said() -> tuple[list[str], list[int]]:
        caplog.clear()
        capsys.readouterr()
        monkeypatch.setattr(backend, "_warned", False)  # a new process
        with caplog.at_level("INFO", logger=backend.__name__):
            assert backend.select_device("auto") == "numpy"
        return (capsys.readouterr().err.splitlines(),
                [r.levelno for r in caplog.records if "no usable GPU" in r.getMessage()])

    lines, levels = said()
    assert len(lines) == 1 and lines[0].startswith("strata: ") and "CuPy is not installed" in lines[0]
    assert levels == []
    assert said() == ([], [20])  # then INFO: seen with -v only
    monkeypatch.setattr(backend, "probe_cuda", lambda: (False, "the CUDA driver does not answer"))
    lines, _ = said()
    assert len(lines) == 1 and "the CUDA driver does not answer" in lines[0]  # a new reason says it again
    assert backend.state_file().read_text() == "the CUDA driver does not answer"


def test_without_a_gpu_the_cpu_path_is_taken_silently(tmp_path, monkeypatch, caplog, capsys):
    """No NVIDIA device at all: nothing on stderr, not even once, an INFO record for -v, no state kept."""
    from coordinator.gpu import probe as backend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(backend, "nvidia_device_present", lambda: False)
    monkeypatch.setattr(backend, "probe_cuda", lambda: (False, "CuPy is not installed"))
    monkeypatch.setattr(backend, "_warned", False)
    with caplog.at_level("INFO", logger=backend.__name__):
        assert backend.select_device("auto") == "numpy"
    assert capsys.readouterr().err == ""
    assert [r.levelno for r in caplog.records] == [20] and not backend.state_file().exists()


def test_an_nvidia_device_is_seen_by_its_driver_entries_or_its_node(tmp_path):
    from coordinator.gpu.probe import nvidia_device_present

    assert not nvidia_device_present(tmp_path)
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus").mkdir(parents=True)
    assert not nvidia_device_present(tmp_path)  # the driver loaded, no GPU listed
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir()
    assert nvidia_device_present(tmp_path)
    other = tmp_path / "other"
    (other / "dev").mkdir(parents=True)
    (other / "dev" / "nvidia0").touch()
    assert nvidia_device_present(other)


def test_a_model_path_naming_some_other_file_is_a_sentence_not_a_traceback(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    err = refused(capsys, "generate", "-m", str(notes), "-p", "hi")
    assert f"{notes} is a file, not a model: give a checkpoint folder" in err and "Traceback" not in err


def test_nodes_left_without_rows_are_reported_in_one_line(tmp_path, caplog):
    from coordinator import Engine, EngineConfig
    from coordinator.cli.make_model import make_model

    model = make_model(tmp_path / "m", num_layers=1, moe_intermediate_size=32)  # one 32-row block for two nodes
    with caplog.at_level("WARNING"), Engine.open(model, EngineConfig(pool="inproc", numa_split=True, nodes=2)):
        pass
    lines = [r.getMessage() for r in caplog.records if "hold no rows" in r.getMessage()]
    assert lines == ["1 of 2 nodes hold no rows of the size-32 experts and sit idle (node 0: its share of 32 rows "
                     "(1/2 of 1 whole 32-row blocks) rounds to zero rows)"]


def test_every_option_has_help_and_make_model_lists_its_presets(capsys):
    import argparse

    from coordinator.cli.make_model import PRESETS

    def actions(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from actions(sub, [*path, name])
            elif not isinstance(a, argparse._HelpAction):
                yield " ".join(path), a

    missing = [f"{where}: {a.option_strings or a.dest}" for where, a in actions(build_parser(), []) if not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        main(["make-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in PRESETS) and "(default tiny)" in text


def test_the_setup_script_installs_once_and_again_only_when_pyproject_changes():
    """tools/_venv.sh (behind ./tools/demo.sh and ./tools/test.sh): a second run installs nothing (its stamp
    is not rewritten) and prints nothing."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv: the suite runs outside ./tools/test.sh")

    def setup() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", ". tools/_venv.sh test && echo ready"], cwd=repo, capture_output=True,
                              text=True, timeout=900)

    assert setup().returncode == 0  # installs only if pyproject.toml changed since the stamp
    stamp = repo / ".venv" / ".strata-installed-test"
    before = stamp.stat().st_mtime_ns
    again = setup()
    assert (again.returncode, again.stdout, again.stderr) == (0, "ready\n", "")
    assert stamp.stat().st_mtime_ns == before


def test_shm_list_shows_a_dead_coordinators_pool_folder_and_clean_all_removes_it(capsys, dev_shm_alone):
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from coordinator.pool.channel import OWNER_FILE, POOL_DIR_PREFIX

    gone = subprocess.run(["true"])  # a finished process: its pid names no live coordinator
    folder = Path(tempfile.mkdtemp(prefix=POOL_DIR_PREFIX))
    try:
        (folder / OWNER_FILE).write_text(json.dumps({"pid": 2**22 + 7, "start": 0.0}))
        (folder / "job.json").write_text("{}")
        assert gone.returncode == 0 and main(["shm", "list"]) == 0
        assert f"{folder}  pool folder  coordinator gone: strata shm clean --all" in capsys.readouterr().out
        assert main(["shm", "list", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert {"folder": str(folder), "owner_alive": False} in doc["pool_folders"]
        main(["shm", "clean", "--all"])  # 1 if some live owner's segment is kept: not this test's business
        assert f"{folder}: removed (its coordinator is gone)" in capsys.readouterr().out
        assert not folder.exists()
    finally:
        if folder.exists():
            import shutil

            shutil.rmtree(folder)


def test_steps_longer_than_two_seconds_show_progress_and_shorter_ones_stay_silent(tmp_path, capsys, monkeypatch):
    """A clock that advances 1 s a reading: the weight load and make-model show their progress on stderr once
    past PROGRESS_AFTER_S, a line a quarter when stderr is not a terminal; with the real clock, a tiny model's
    steps stay silent."""
    from coordinator import Engine, EngineConfig
    from shm import progress

    assert main(["make-model", "--out", str(tmp_path / "quiet"), "--layers", "2"]) == 0
    assert capsys.readouterr().err == ""  # fast: nothing shown
    clock = iter(range(10**6))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    assert main(["make-model", "--out", str(tmp_path / "m"), "--layers", "4"]) == 0
    err = capsys.readouterr().err
    assert "make-model: drawing the weights: 50% 2 of 4 layers" in err and "100% 4 of 4 layers" in err
    with Engine.open(tmp_path / "m", EngineConfig(pool="inproc")):
        pass
    err = capsys.readouterr().err
    assert "loading the non-expert weights: 100%" in err and "tensors" in err


def test_shm_list_placement_judges_a_virtual_nodes_pages_by_its_owners_real_node(capsys):
    """A segment of virtual node 1 (the plan's node id, not a memory node), its pages touched by its owner on
    real node 0: local, as the worker reports it in bench, not 0 % for want of a memory node 1."""
    import json

    from shm import segments
    from shm.placement import owner_node
    from shm.topology import real_nodes

    real = [n for n in real_nodes() if n.cpus]
    if len(real) != 1:
        pytest.skip("the test needs this process's CPUs on one real node")
    name = f"/{segments.PREFIX}cli-placement-{os.getpid()}.node1"
    seg = segments.create(name, 1, "m" * 16, "p" * 16, {"kind": "test"}, 1 << 20)
    try:
        seg.data[:] = 1  # first touch: the pages land on this process's node
        assert owner_node(os.getpid(), 1) == real[0].id
        assert main(["shm", "list", "--placement", "--json"]) == 0
        row = [r for r in json.loads(capsys.readouterr().out)["segments"] if r["name"] == name][0]
        assert row["node"] == 1 and row["placement"]["local_share"] == 1.0
    finally:
        seg.close()
        segments.unlink(name)


# -- what a newcomer types (issue 43) --------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_llama_cpp_flags_mean_what_they_mean_there():
    """-c/--ctx-size, -s, --temp, -f, --min-p, --repeat-penalty, --n-predict; and every command that generates
    takes the same default -n."""
    parser = build_parser()
    args = parser.parse_args(["generate", "-m", "M", "-f", __file__, "-c", "2048", "-s", "7", "--temp", "0.5",
                              "--min-p", "0.05", "--repeat-penalty", "1.1", "--n-predict", "9"])
    assert (args.max_seq_len, args.seed, args.temperature, args.min_p, args.repetition_penalty, args.max_new_tokens) \
        == (2048, 7, 0.5, 0.05, 1.1, 9)
    assert str(args.file) == __file__ and args.prompt is None
    defaults = {cmd: parser.parse_args(argv).max_new_tokens for cmd, argv in (
        ("generate", ["generate", "-m", "M", "-p", "x"]), ("chat", ["chat", "-m", "M"]), ("client", ["client", "x"]),
        ("profile", ["profile", "-m", "M", "--prompts", __file__, "--out", "p.json"]))}
    assert len(set(defaults.values())) == 1, defaults


def test_config_mistakes_name_the_flags_not_the_config_fields(tmp_path, capsys):
    err = refused(capsys, "generate", "-m", str(tmp_path / "absent"), "-p", "hi", "--nodes", "2")
    assert "--nodes 2 needs --numa-split" in err and "numa_split" not in err and "absent" not in err
    err = refused(capsys, "generate", "-m", str(tmp_path / "absent"), "-p", "hi", "--gpu-expert-memory", "1")
    assert "--gpu-expert-memory places the hottest experts: it needs --expert-profile" in err


def test_the_prompt_from_a_file_or_stdin(tiny, tmp_path, capsys, monkeypatch):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time")
    assert main(["generate", "-m", str(tiny), "-f", str(prompt), "-n", "3", "--pool", "inproc", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["generate", "-m", str(tiny), "-p", "Once upon a time", "-n", "3", "--pool", "inproc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == from_file["ids"]
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("Once upon a time"))
    assert main(["generate", "-m", str(tiny), "-p", "-", "-n", "3", "--pool", "inproc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == from_file["prompt_ids"]
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(""))
    err = refused(capsys, "generate", "-m", str(tiny), "-p", "-")
    assert "the prompt from standard input (-p -) is empty" in err


def test_min_p_and_the_repeat_penalty_reach_the_sampler(tiny, capsys):
    """Greedy on the tiny model repeats itself; a strong repeat penalty takes other tokens (and --min-p 1 with a
    temperature keeps only the most likely token: the greedy answer)."""
    def ids(*flags) -> list[int]:
        assert main(["generate", "-m", str(tiny), "--prompt-ids", "72,101", "-n", "12", "--pool", "inproc", "--json",
                     *flags]) == 0
        return json.loads(capsys.readouterr().out)["ids"]

    greedy = ids()
    penalised = ids("--repeat-penalty", "50")
    assert len(set(greedy)) < len(greedy) and penalised != greedy
    assert len(set(penalised)) > len(set(greedy))
    assert ids("--temp", "1.5", "--min-p", "1", "-s", "3") == greedy


def test_make_model_writes_a_chat_template_and_names_an_unwritable_out(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--out", str(out), "--layers", "1"]) == 0
    from coordinator.text.chat_template import load_chat_template

    template = load_chat_template(out)
    assert template is not None and template.eos_token == "<|im_end|>"
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    capsys.readouterr()
    err = refused(capsys, "make-model", "--out", "/proc/self/strata-test")
    assert "--out /proc/self/strata-test: the folder cannot be written (" in err and "GiB" not in err
    err = refused(capsys, "make-model", "--out", "/sys/strata-test")
    assert "--out /sys/strata-test: the folder cannot be written (" in err and "Traceback" not in err
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    err = refused(capsys, "make-model", "--out", str(a_file), "--force")
    assert f"--out {a_file} is a file" in err and a_file.read_text() == "mine"


def test_bench_checks_for_matplotlib_before_measuring(tmp_path, capsys, monkeypatch):
    from coordinator.cli import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before the check"))
    err = refused(capsys, "bench", "-m", str(tmp_path / "absent"), "--plot", str(tmp_path / "p.png"))
    assert "--plot needs matplotlib: pip install 'strata-numa[plot]'" in err


def test_bench_sizes_its_stream_array_by_the_machine():
    from coordinator.cli.bench import STREAM_MAX_BYTES, STREAM_MIN_BYTES, stream_bytes

    gib, mib = 1 << 30, 1 << 20
    assert stream_bytes(32 * mib, 64 * gib) == 128 * mib  # four times the L3
    assert stream_bytes(480 * mib, 2 * gib) == 128 * mib  # a guest's big L3 on a small machine: its memory decides
    assert stream_bytes(480 * mib, 512 * gib) == STREAM_MAX_BYTES
    assert stream_bytes(1 * mib, 64 * gib) == STREAM_MIN_BYTES


def test_serve_without_bind_takes_a_free_port_when_the_default_is_taken(tiny, tmp_path):
    import socket

    from coordinator.serving.api import DEFAULT_ADDRESS

    host, port = DEFAULT_ADDRESS.rsplit(":", 1)[0][len("tcp://"):], int(DEFAULT_ADDRESS.rsplit(":", 1)[1])
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind((host, port))
        holder.listen()
    except OSError:
        pass  # another server holds it already: the same case
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "-m", str(tiny), "--pool", "inproc"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert re.fullmatch(r"serving on tcp://127\.0\.0\.1:(\d+)\n", line) and not line.endswith(f":{port}\n"), line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        holder.close()
    assert f"{DEFAULT_ADDRESS} is in use" in err and "Traceback" not in err


def test_launch_script_help():
    out = subprocess.run(["bash", str(REPO / "tools" / "launch.sh"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "tools/launch.sh generate --model DIR" in out.stdout
    assert subprocess.run(["bash", str(REPO / "tools" / "launch.sh")], capture_output=True).returncode == 2


# -- every command resolves its settings the same way, with one default each (issue 44) ------------------------

class Opened(Exception):
    """Raised in place of loading an engine: the config it was given is the test's answer."""


COMMANDS = {  # argv after the model; each command opens one engine first (bench: its one mode)
    "generate": ["generate", "-p", "hi"],
    "chat": ["chat"],
    "serve": ["serve", "--bind", "ipc://{tmp}/serve/sock"],
    "bench": ["bench", "--modes", "inproc", "--quality-positions", "0"],
}


def opened_config(monkeypatch, tmp_path, tiny, command: str, *extra: str):
    """The EngineConfig ``strata COMMAND`` opens its engine with (Engine.open stopped there)."""
    from coordinator.engine import Engine

    seen = []

    def stop(model_dir, config=None, *args, **kwargs):
        seen.append(config)
        raise Opened

    monkeypatch.setattr(Engine, "open", stop)
    name, *rest = COMMANDS[command]
    argv = [name, "-m", str(tiny), *(a.format(tmp=tmp_path) for a in rest), *extra]
    with pytest.raises(Opened):
        main(argv)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_a_strata_variable_and_its_flag_beats_it(monkeypatch, tmp_path, tiny, command):
    """flag > STRATA_* variable > default, through one function (cli/flags.engine_config), in every command
    that opens an engine: strata bench's engines too, whose mode sets the pool."""
    assert opened_config(monkeypatch, tmp_path, tiny, command).expert_dtype == "auto"
    monkeypatch.setenv("STRATA_EXPERT_DTYPE", "q8")
    monkeypatch.setenv("STRATA_ROUTE_TAIL_SKIP", "0.01")  # a setting without a flag in bench
    config = opened_config(monkeypatch, tmp_path, tiny, command)
    assert (config.expert_dtype, config.route_tail_skip) == ("q8", 0.01)
    config = opened_config(monkeypatch, tmp_path, tiny, command, "--expert-dtype", "q4")
    assert (config.expert_dtype, config.route_tail_skip) == ("q4", 0.01)
    if command == "bench":
        assert config.pool == "inproc"  # the mode's, whatever STRATA_POOL says


def test_bench_modes_set_the_pool_whatever_the_variables_say(monkeypatch, tmp_path, tiny):
    monkeypatch.setenv("STRATA_POOL", "process")
    monkeypatch.setenv("STRATA_NUMA_SPLIT", "1")
    config = opened_config(monkeypatch, tmp_path, tiny, "bench")
    assert (config.pool, config.numa_split, config.nodes) == ("inproc", False, None)


def test_help_texts_take_the_defaults_from_the_config(capsys):
    from coordinator.config import EngineConfig
    from coordinator.request import DEFAULT_MAX_NEW_TOKENS

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(STRATA_WORKER_RESTART_WINDOW; default {EngineConfig.worker_restart_window:g})" in text
    assert f"(STRATA_PREFILL_CHUNK; default {EngineConfig.prefill_chunk})" in text
    assert f"(STRATA_ACTIVATIONS; default {EngineConfig.activations})" in text
    assert "(STRATA_POOL; default process)" in text  # the command line's, not the library's
    assert f"the most tokens to generate (default {DEFAULT_MAX_NEW_TOKENS})" in text
    from coordinator.cli import main as cli_main, flags

    for module in (cli_main, flags):  # no number written into a help text as a default
        assert not re.search(r"\(default \d", Path(module.__file__).read_text()), module


def test_one_default_for_max_new_tokens_everywhere():
    """The engine's generate, the ZeroMQ API's request and every generating command take the same default."""
    import inspect

    from coordinator.engine import Engine
    from coordinator.request import DEFAULT_MAX_NEW_TOKENS, Limits
    from coordinator.serving.api import decode_request

    defaults = {
        "generate_full": inspect.signature(Engine.generate_full).parameters["max_new_tokens"].default,
        "generate": inspect.signature(Engine.generate).parameters["max_new_tokens"].default,
        "api": decode_request(json.dumps({"type": "generate", "id": "a", "prompt": "x"}).encode(),
                              Limits()).max_new_tokens,
        **{cmd: build_parser().parse_args(argv).max_new_tokens for cmd, argv in (
            ("cli generate", ["generate", "-m", "M", "-p", "x"]), ("cli chat", ["chat", "-m", "M"]),
            ("cli client", ["client", "x"]), ("cli profile", ["profile", "-m", "M", "--prompts", __file__, "--out",
                                                               "p.json"]))},
    }
    assert set(defaults.values()) == {DEFAULT_MAX_NEW_TOKENS}, defaults


def test_generate_stops_on_a_stop_string(tiny, capsys):
    """--stop ends the answer before the first place the text holds it, streamed and in --json alike; the ids
    end with the token that completed it."""
    def run(*extra: str) -> tuple[dict, str]:
        capsys.readouterr()
        argv = ["generate", "-m", str(tiny), "-p", "Hello", "-n", "24", "--pool", "inproc", "-q", *extra]
        assert main([*argv, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main(argv) == 0
        return doc, capsys.readouterr().out

    whole, _ = run()
    text = whole["text"]
    assert whole["finish_reason"] == "length" and len(text) >= 4, whole
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text.index(stop)
    doc, streamed = run("--stop", stop, "--stop", "never in it \u2603")
    assert doc["finish_reason"] == "stop" and doc["text"] == text[:cut] and streamed == text[:cut] + "\n"
    assert 0 < len(doc["ids"]) < len(whole["ids"]) and doc["ids"] == whole["ids"][:len(doc["ids"])]
