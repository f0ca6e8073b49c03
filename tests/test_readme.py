"""The README as a newcomer meets it: short, no history, every command and Python example runs as written on
the demo model its quick start makes (/tmp/tiny here a test's own), its configuration table matches
coordinator/config.py, every relative link in it and docs/ leads somewhere; and tools/bench_table.py, which
writes docs/benchmarks.md's tables, on what the benchmarks really print and write."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from served import start_server, stop_server

from coordinator import config as config_module
from coordinator.config import API_KEY_VAR, ENV_VARS, EngineConfig
from coordinator.serving.api import DEFAULT_ADDRESS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
DEMO = "/tmp/tiny"  # the README's demo model path; a test's own folder here
MAX_LINES = 300

sys.path.insert(0, str(REPO / "tools"))
import bench_table  # noqa: E402  (tools/bench_table.py)


def readme() -> str:
    return README.read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme(), re.S)


def strata_env() -> dict:
    """This environment less every STRATA_* variable (the README's commands run on the defaults), with this
    interpreter's scripts (strata) first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=strata_env(), capture_output=True, text=True,
                          timeout=300)


# -- the Python examples --------------------------------------------------------------------------------------


def test_the_engine_example_runs_as_pasted(tiny_model, tmp_path):
    block = next(b for b in python_blocks() if "Engine.open(" in b)
    model = tiny_model("tiny", seed=0)
    out = run(block.replace(f'"{DEMO}"', repr(str(model))), tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.match(r"\(5, 320\) ", out.stdout), out.stdout  # "Hello": five byte-level tokens, the tiny vocabulary


def test_the_client_example_runs_as_pasted(server, tmp_path):
    block = next(b for b in python_blocks() if "Client(" in b)
    out = run(block.replace(f'"{DEFAULT_ADDRESS}"', repr(server.address)), tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"(length|stop) \{.*\}\nTrue ", out.stdout), out.stdout


# -- short, no history, links that lead somewhere ---------------------------------------------------------------

HASH = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/-])")  # a commit hash (with a digit, below)
DATE = re.compile(r"(?<!\d)(?:19|20)\d\d-[01]\d-[0-3]\d(?!\d)")


def history_in(text: str) -> list[str]:
    """Commit hashes (7 to 40 hex digits, at least one of them a digit) and dates (2026-12-04) in ``text``."""
    hashes = [m.group(0) for m in HASH.finditer(text) if re.search(r"\d", m.group(0))]
    return hashes + DATE.findall(text)


def test_history_is_recognised():
    assert history_in("at c1bfa1b and d9f3248, on 2026-12-04") == ["c1bfa1b", "d9f3248", "2026-12-04"]
    assert history_in("Q4_K_M 0.5625 bytes; 151936 x 2048; sha256 of pyproject.toml; /dev/shm; e4m3; 0x7F") == []


def test_the_readme_is_short_and_holds_no_history():
    text = readme()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines; at most {MAX_LINES}"
    assert not history_in(text), f"README.md names commits or dates: {history_in(text)} (history goes in commits)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_hold_no_history(doc):
    assert not history_in(doc.read_text()), f"{doc.name} names commits or dates: {history_in(doc.read_text())}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or REPO not in file.parents:
            broken.append(f"{target} (no file {path} in the repository)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{doc.name}: broken links: {broken}"


PATH_WORD = re.compile(r"(?<![\w/.~-])(?:coordinator|node_worker|shm|tools|tests|docs)/[\w./-]*")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_file_named_exists(doc):
    """A file or folder of the repository named in the text (coordinator/pool/process.py, tools/launch.sh)
    is there: the documents follow the code when it moves."""
    named = {m.group(0).rstrip(".") for m in PATH_WORD.finditer(doc.read_text())}
    missing = sorted(n for n in named if not (REPO / n).exists())
    assert not missing, f"{doc.name} names files the repository does not have: {missing}"


def test_the_package_map_is_the_tree():
    """Every folder and module docs/architecture.md's package map names is where it says."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"## Package map\n+```\n(.*?)```", text, re.S).group(1)
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders above the current line
    missing = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip())[0]
        if not names or indent >= 20:  # a continued description
            continue
        folders = [(i, f) for i, f in folders if i < indent]
        base = folders[-1][1] if folders else ""
        for name in names.split():
            path = base + name
            if not (REPO / path).exists():
                missing.append(path)
            if name.endswith("/"):
                folders.append((indent, path))
    assert not missing, f"the package map names what the tree does not have: {missing}"


# -- the configuration table ---------------------------------------------------------------------------------


def config_table() -> dict[str, dict[str, str]]:
    """The README's configuration table: variable -> {"flag", "default", "meaning"} as written (backticks off
    the variable and default)."""
    section = readme().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[0].startswith("`STRATA_"):
            var = cells[0].strip("`")
            assert var not in rows, f"{var} is in the table twice"
            rows[var] = {"flag": cells[1], "default": cells[2].strip("`"), "meaning": cells[3]}
    return rows


def declared_variables() -> set[str]:
    """Every STRATA_* variable coordinator/config.py declares: ENV_VARS', the API key's, and any other it names."""
    named = set(re.findall(r"\bSTRATA_[A-Z0-9_]+\b", Path(config_module.__file__).read_text()))
    return {var for var, _ in ENV_VARS.values()} | {API_KEY_VAR} | named


def test_the_configuration_table_lists_every_variable_once():
    table = set(config_table())
    declared = declared_variables()
    assert not declared - table, f"variables missing from the README's configuration table: {declared - table}"
    assert not table - declared, f"rows for variables coordinator/config.py does not declare: {table - declared}"


def test_the_configuration_tables_defaults_are_engineconfigs():
    table, defaults = config_table(), EngineConfig()
    for field, (var, parse) in ENV_VARS.items():
        written = table[var]["default"]
        value = None if written == "none" else parse(written)
        assert value == getattr(defaults, field), \
            f"{var}: the README's default {written!r} is {value!r}; EngineConfig's is {getattr(defaults, field)!r}"


def subcommands() -> dict:
    from coordinator.cli.main import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices


def test_the_configuration_tables_flags_are_the_commands():
    """Each flag named exists, and each variable with a `strata generate` flag names it (or one of its
    spellings); a variable said to have none has none."""
    commands = subcommands()
    options = {opt for p in commands.values() for a in p._actions for opt in a.option_strings}
    generate = {a.dest: a.option_strings for a in commands["generate"]._actions}
    table = config_table()
    for field, (var, _) in ENV_VARS.items():
        named = set(re.findall(r"`(-[-\w]+)`", table[var]["flag"]))
        assert named <= options, f"{var}: no command has {named - options}"
        if field in generate:
            assert named & set(generate[field]), f"{var}: give its flag, one of {generate[field]}"
        elif table[var]["flag"] == "none":
            assert not any(a.dest == field for p in commands.values() for a in p._actions), \
                f"{var}: the table says it has no flag, but a command has one"


# -- every shell command, as written, on the demo model --------------------------------------------------------

SKIPPED = {  # the first word of a command the tests do not run, and why
    "pip": "installs packages", "hf": "downloads from the Hugging Face Hub",
    "./tools/demo.sh": "installs into .venv (tools/test.sh runs the suite that tests it)",
    "./tools/test.sh": "runs the suite (test_the_quick_tier_is_the_suite_less_its_slow_tests checks --quick)",
}
SERVED = ("serve", "client", "curl")  # need the server: test_the_serving_commands_run


def shell_commands() -> list[str]:
    """Every command line of the README's ```sh blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", readme(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return lines


def program(line: str) -> list[str]:
    """The words of the command that runs (after VAR=value assignments, past an ``echo ... |``)."""
    words = shlex.split(line.split(" | ")[-1], comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words


def kind(line: str) -> str:
    words = program(line)
    if words[0] == "curl" or words[:2] in (["strata", "serve"], ["strata", "client"]):
        return "served"
    if words[0] in SKIPPED:
        return "skipped"
    if words[0] in ("strata", "tools/launch.sh"):
        return "run"
    return "unknown"


def on_demo(line: str, model: Path) -> str:
    """The command on the demo model: /tmp/tiny, and any ~/models/... model path, become ``model``."""
    return re.sub(r"~/models/\S+", str(model), line.replace(DEMO, str(model)))


def test_every_readme_command_is_run_or_skipped_for_a_reason():
    commands = shell_commands()
    assert [c for c in commands if kind(c) == "unknown"] == [], \
        f"commands the tests neither run nor skip (add them to SKIPPED with the reason): " \
        f"{[c for c in commands if kind(c) == 'unknown']}"
    assert any(program(c)[:2] == ["strata", "make-model"] for c in commands), "the quick start makes no demo model"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    """The README's own make-model line, into a folder of this module's."""
    line = next(c for c in shell_commands() if program(c)[:2] == ["strata", "make-model"])
    model = tmp_path_factory.mktemp("readme") / "tiny"
    out = subprocess.run(["bash", "-c", on_demo(line, model)], env=strata_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and (model / "config.json").is_file(), out.stderr
    return model


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


RUN = [c for c in shell_commands() if kind(c) == "run" and program(c)[:2] != ["strata", "make-model"]]


@pytest.mark.slow
@pytest.mark.parametrize("line", RUN, ids=lambda line: re.sub(r"\s+#.*$", "", line))
def test_the_readmes_command_runs_as_written(line, demo_model, tmp_path, request):
    words = program(line)
    if "--nodes" in words and int(words[words.index("--nodes") + 1]) > usable_cpus():
        pytest.skip(f"{usable_cpus()} CPU(s): a split over {words[words.index('--nodes') + 1]} nodes is refused")
    command = on_demo(line, demo_model)
    if words[:3] == ["strata", "shm", "clean"]:
        request.getfixturevalue("dev_shm_alone")  # it removes every dead owner's segment, another test's too
    stdin = "hello\n" if "chat" in words else ""  # a chat reads lines until the end of its input
    cwd = REPO if words[0].startswith("tools/") else tmp_path
    out = subprocess.run(["bash", "-c", command], cwd=cwd, env=strata_env(), input=stdin, capture_output=True,
                         text=True, timeout=600)
    if words[:3] == ["strata", "shm", "clean"] and out.returncode == 1:
        # status 1: it kept segments whose owner is alive (another run's, on a shared machine), and says so
        said = out.stdout.splitlines()
        assert any(": kept: owner pid" in l for l in said), out.stdout + out.stderr
        assert all(": kept: owner pid" in l or l.endswith(": removed") for l in said), out.stdout + out.stderr
        return
    assert out.returncode == 0, f"{command}\nstdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-4000:]}"


@pytest.mark.slow
def test_the_serving_commands_run(demo_model, tmp_path):
    """The README's `strata serve` line on the demo model (any free ports in place of its own), then its client
    and curl lines against it."""
    served = [c for c in shell_commands() if kind(c) == "served"]
    serve_line = next(c for c in served if program(c)[:2] == ["strata", "serve"])
    words = shlex.split(on_demo(serve_line, demo_model), comments=True)[2:]
    i = next(k for k, w in enumerate(words) if w in ("-m", "--model"))
    assert words[i + 1] == str(demo_model), serve_line
    del words[i:i + 2]
    if "--nodes" in words and int(words[words.index("--nodes") + 1]) > usable_cpus():
        pytest.skip(f"{usable_cpus()} CPU(s): a split over {words[words.index('--nodes') + 1]} nodes is refused")
    http = words.index("--http") + 1 if "--http" in words else None
    readme_url = f"http://{words[http]}" if http else None
    if http:
        words[http] = words[http].rsplit(":", 1)[0] + ":0"
    s = start_server(demo_model, tmp_path, *words, pool=None)  # the command line's own pool (process)
    try:
        for line in served:
            if line is serve_line:
                continue
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["strata", "client"]:
                argv += ["--address", s.address]
            elif argv[0] == "curl":
                assert readme_url and s.http_url, "curl lines need the serve line's --http"
                argv = [a.replace(readme_url, s.http_url) for a in argv]
                argv[1:1] = ["-sS", "--fail", "--max-time", "60"]  # an HTTP error is a failure here
            out = subprocess.run(argv, env=strata_env(), capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
            if "/v1/models" in line:
                assert json.loads(out.stdout)["data"], out.stdout
            if '"stream": true' in line:
                assert "data: [DONE]" in out.stdout, out.stdout
    finally:
        assert stop_server(s) == 0, s.stderr()


# -- tools/bench_table.py ------------------------------------------------------------------------------------

FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
print(json.dumps([{{"n_prompt": p, "n_gen": 0, "avg_ts": 100.0, "samples_ts": [100.0]}},
                  {{"n_prompt": 0, "n_gen": n, "avg_ts": 20.0, "samples_ts": [20.0]}}]))
"""


@pytest.mark.slow
def test_bench_table_reads_what_the_benchmarks_write(demo_model, tmp_path):
    """tools/vs_llama.py (llama-bench stood in for by a script printing its JSON) and strata bench --json, run for
    real on the demo model: the table holds their figures, and the commands that made them."""
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"  # llama-bench's model: only its name reaches the table
    gguf.write_bytes(b"")
    out = subprocess.run([sys.executable, "tools/vs_llama.py", "--model", str(gguf), "--llama-bench", str(fake),
                          "--rounds", "2", "--prompt-tokens", "8", "--tokens", "4", "--strata-model", str(demo_model)],
                         cwd=REPO, env=strata_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    (tmp_path / "vs.txt").write_text(out.stdout)
    report = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "coordinator", "bench", "-m", str(demo_model), "--modes", "inproc",
                          "--tokens", "4", "--prompt-tokens", "8", "--rounds", "1", "--quality-positions", "0",
                          "--json", str(report)], cwd=REPO, env=strata_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]

    run_ = bench_table.parse_vs_llama((tmp_path / "vs.txt").read_text(), "vs.txt")
    assert (len(run_.rounds), run_.threads, run_.prompt_tokens, run_.tokens) == (2, 2, 8, 4)
    assert run_.strata_model == str(demo_model) and run_.model == str(gguf)
    assert [r["llama.cpp"] for r in run_.rounds] == [{"decode": 20.0, "prefill": 100.0}] * 2
    ours = [r[str(REPO)] for r in run_.rounds]
    text = bench_table.block("test", [run_], [bench_table.read_bench(str(report))], about="this host")
    assert text.startswith("Host: this host; kernels compiled for ")
    decode = sorted(r["decode"] / 20.0 for r in ours)
    row = next(line for line in text.splitlines() if line.startswith("| `tiny` / `m.gguf` | 2 |"))
    assert f"| {sum(decode) / 2:.2f}x ({decode[0]:.2f}-{decode[1]:.2f}x) |" in row, row
    assert f"--strata-model {demo_model}" in text and "tools/vs_llama.py --model" in text
    bench_row = next(line for line in text.splitlines() if line.startswith("| `tiny` | inproc |"))
    mode = json.loads(report.read_text())["modes"]["inproc"]
    assert f"| {mode['expert_format']} / {mode['dense_format']} | {mode['decode_tokens_per_s']['median']:.1f} |" \
        in bench_row, bench_row
    assert f"strata bench -m {demo_model} --modes inproc --tokens 4 --prompt-tokens 8 --rounds 1" in text


VS_LLAMA_OUTPUT = """round 1: llama.cpp decode 20.0 prefill 100.0; /src/strata decode 30.0 prefill 90.0
round 2: llama.cpp decode 25.0 prefill 100.0; /src/strata decode 25.0 prefill 120.0
round 3: llama.cpp decode 20.0 prefill 80.0; /src/strata decode 22.0 prefill 100.0

llama.cpp on /m/qg-q8_0.gguf, strata on /m/qg-q8_0.gguf , 2 threads, pp64 / tg32, tok/s (the median of 1 \
repetitions) and ratio to llama.cpp in the same round

| round | llama.cpp decode | llama.cpp prefill | /src/strata decode | /src/strata prefill |
"""


def test_bench_table_writes_its_hosts_block_and_nothing_else(tmp_path):
    """The lines tools/vs_llama.py prints (its print calls' format) -> a row; --write replaces the text between
    the host's markers only, a section after them (the design measurements) kept."""
    (tmp_path / "vs.txt").write_text(VS_LLAMA_OUTPUT)
    doc = tmp_path / "benchmarks.md"
    before = "# Benchmarks\n\n<!-- table:avx2 begin -->\nold avx2\n<!-- table:avx2 end -->\n\n"
    after = "\n<!-- table:avx512 begin -->\nold avx512\n<!-- table:avx512 end -->\n\n" \
            "## Measurements behind design choices\n\nkept\n"
    doc.write_text(before + after)
    assert bench_table.main(["--host", "avx2", "--vs-llama", str(tmp_path / "vs.txt"), "--about", "a host",
                             "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n<!-- table:avx2 begin -->\nHost: a host.\n") and text.endswith(after)
    assert "| `qg-q8_0.gguf` itself | 3 | 25.0 / 20.0 | 1.10x (1.00-1.50x) | 100.0 / 100.0 | 1.20x (0.90-1.25x) |" \
        in text
    assert "tools/vs_llama.py --model /m/qg-q8_0.gguf --llama-bench LLAMA_BENCH --rounds 3" in text
    assert "tools/bench_table.py --host avx2 --vs-llama" in text
    assert bench_table.main(["--host", "avx9", "--vs-llama", str(tmp_path / "vs.txt"), "--write", str(doc)]) == 2
    (tmp_path / "bad.txt").write_text("round 1: nothing here\n")
    assert bench_table.main(["--host", "avx2", "--vs-llama", str(tmp_path / "bad.txt")]) == 2


def test_the_benchmark_documents_markers_pair_up():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    begins = re.findall(r"<!-- table:([\w.-]+) begin -->", text)
    ends = re.findall(r"<!-- table:([\w.-]+) end -->", text)
    assert begins and begins == ends and len(set(begins)) == len(begins), (begins, ends)
    for host in begins:  # each block can be rewritten in place
        assert bench_table.replace_block(text, host, "x\n").count(f"<!-- table:{host} begin -->\nx\n<!--") == 1
