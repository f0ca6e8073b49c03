"""strata bench on the tiny model: the report's structure and its internal consistency, not its speed."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

import coordinator.cli.bench as bench
from coordinator.cli.main import main
from coordinator.cli.make_model import ModelTooLarge, bench_small, l3_bytes, make_model, parameter_count
from coordinator.model.model_config import load_model_config
from shm.topology import real_nodes


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    model = make_model(d / "m", seed=2)
    out = d / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc,single,split", "--nodes", "2", "--tokens", "4",
                 "--prompt-tokens", "6", "--rounds", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_mode_and_figure_is_reported(report):
    assert list(report["modes"]) == ["inproc", "single", "split"]
    cfg = load_model_config(report["model"])  # K and V, float32, every layer
    assert report["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 > 0
    for mode, m in report["modes"].items():
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            s = m[key]
            assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0, (mode, key)
        L = m["moe_layer_decode"]
        assert L["calls"] > 0 and L["wall_us"]["median"] >= L["compute_us"]["median"] > 0
        assert m["membw"]["gb_per_s"] > 0 and m["pool_gb_per_s"] > 0
        assert m["bandwidth_ratio"] == pytest.approx(m["pool_gb_per_s"] / m["membw"]["gb_per_s"])
        split = m["step_split"]  # every mode's decode step split, the experts' part the pool's wait in a process
        ran = {name: p for name, p in split["parts"].items() if name != "attention"}  # decode's in the block
        assert split["tokens"] == 4 and all(p["us"] > 0 for p in ran.values()), mode
        assert split["parts"]["attention"]["us"] == 0 and split["parts"]["attention block"]["mb"] > 0, mode
        assert split["stream_gb_per_s"] == m["membw"]["gb_per_s"]
    assert report["modes"]["inproc"]["decode_vs_inproc"] == 1.0
    for mode in ("single", "split"):
        m = report["modes"][mode]
        assert m["empty_round_trip_us"]["median"] > 0 and m["overhead_vs_floor"] is not None
        L = m["moe_layer_decode"]
        hops = L["to_worker_us"]["median"] + L["in_worker_us"]["median"] + L["to_coordinator_us"]["median"]
        # each node's hops fit inside the layer's wall time; each hop is the slowest node's, maybe not the same node
        nodes = len(m["nodes"])
        assert 0 < hops <= nodes * L["wall_us"]["max"]
    assert report["modes"]["inproc"]["moe_layer_decode"]["to_worker_us"]["n"] == 0


@pytest.mark.slow
def test_bytes_counted_equal_bytes_implied_by_routing(report):
    for mode, m in report["modes"].items():
        b = m["bytes"]
        assert b["counted"] == b["implied_by_routing"] > 0, mode
        assert b["expert_loads"] <= b["routed_pairs"]
    # the three modes ran the same prompts greedily: the same routing
    loads = {m["bytes"]["expert_loads"] for m in report["modes"].values()}
    assert len(loads) == 1


@pytest.mark.slow
def test_hot_experts_from_a_profile_are_benched_in_every_mode(tmp_path, capsys):
    """--expert-profile/--gpu-experts apply to every mode: the device serves a share of the pairs, the CPU
    side reads fewer expert bytes than without them, and the counted bytes still match the routing."""
    model = make_model(tmp_path / "m", seed=2)
    prompts, profile = tmp_path / "prompts.txt", tmp_path / "profile.json"
    prompts.write_text("hello world\nthe quick brown fox\n")
    assert main(["profile", "--model", str(model), "--prompts", str(prompts), "--out", str(profile),
                 "--max-new-tokens", "4", "--pool", "inproc"]) == 0
    runs = {}
    for name, extra in (("cpu only", []), ("hot", ["--expert-profile", str(profile), "--gpu-experts", "8"])):
        out = tmp_path / f"{name}.json"
        assert main(["bench", "--model", str(model), "--modes", "inproc,split", "--tokens", "4", "--prompt-tokens",
                     "6", "--rounds", "1", "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "8 experts on it (profile" in text and "hit rate" in text
    assert runs["hot"]["device"] == {"expert_profile": str(profile), "gpu_experts": 8}
    for mode in ("inproc", "split"):
        cold, hot = runs["cpu only"]["modes"][mode], runs["hot"]["modes"][mode]
        assert cold["experts"]["hit_rate"] == 0 and cold["experts"]["device_experts"]["experts"] == 0
        assert 0 < hot["experts"]["hit_rate"] < 1 and hot["experts"]["device_experts"]["experts"] == 8
        assert hot["experts"]["device_bytes_read"] > 0
        assert hot["bytes"]["counted"] == hot["bytes"]["implied_by_routing"] < cold["bytes"]["counted"]


@pytest.mark.slow
def test_nodes_are_described_and_virtual_nodes_labelled(report):
    split = report["modes"]["split"]["nodes"]
    assert [n["node"] for n in split] == [0, 1]
    rows = [n["slice_rows"] for n in split]
    assert rows[0][0] == 0 and rows[0][1] == rows[1][0] and rows[1][1] == 80  # the tiny model's I
    assert all(n["threads"] >= 1 and n["cpus"] for n in split)
    virtual = len([n for n in real_nodes() if n.cpus]) < 2  # two nodes are cut from one when the machine has one
    assert [n["virtual"] for n in split] == [virtual, virtual]
    single = report["modes"]["single"]["nodes"]
    assert len(single) == 1 and single[0]["slice_rows"] == [0, 80] and single[0]["virtual"] is False


def test_bench_small_exceeds_the_cache_several_times():
    g = bench_small()
    expert_bytes = g.num_layers * g.num_experts * 3 * g.hidden_size * g.moe_intermediate_size * 4
    assert expert_bytes >= 8 * l3_bytes()


def test_a_preset_that_does_not_fit_is_refused_before_writing(tmp_path):
    out = tmp_path / "big"
    with pytest.raises(ModelTooLarge, match="GiB"):
        make_model(out, preset="qwen3-30b-a3b")  # 48 layers: far beyond this machine
    assert not out.exists()


def test_modes_that_would_not_fit_together_are_refused_after_the_first(tmp_path, monkeypatch, capsys):
    """The first engine seems to take 4 GiB of 10 available: the other two would need 8 GiB of the 6 left, so
    the bench stops with the numbers and a remedy instead of meeting the OOM killer, and closes what it opened."""
    model = make_model(tmp_path / "m", seed=2)
    readings = iter([10 * 2**30, 6 * 2**30])
    monkeypatch.setattr(bench.psutil, "virtual_memory", lambda: SimpleNamespace(available=next(readings)))
    opened, closed = [], []
    real_open, real_close = bench.Engine.open, bench.Engine.close
    monkeypatch.setattr(bench.Engine, "open", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    monkeypatch.setattr(bench.Engine, "close", lambda self: closed.append(self) or real_close(self))
    assert main(["bench", "--model", str(model), "--modes", "inproc,single,split", "--tokens", "4",
                 "--prompt-tokens", "6", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "inproc took up to 4.0 GiB" in err and "single, split would need about 8.0 GiB" in err, err
    assert "6.0 GiB available" in err and "--modes" in err
    assert len(opened) == 1 and closed == opened


def test_the_other_modes_are_closed_before_the_f32_reference_opens(tmp_path, monkeypatch):
    """--quality-positions opens one more engine (f32 experts and dense matrices: the largest): by then the
    modes after the first are measured and closed, and the compared engine is closed once its logits are
    taken, so the reference opens alone."""
    model = make_model(tmp_path / "m", seed=4)
    live, seen = [], []
    real_open, real_close = bench.Engine.open, bench.Engine.close

    def opening(model_dir, config=None, *args, **kwargs):
        if config is not None and config.activations == "f32" and config.expert_dtype == "f32":
            seen.append(len(live))  # engines open as the reference opens
        eng = real_open(model_dir, config, *args, **kwargs)
        live.append(eng)
        return eng

    def closing(self):
        live.remove(self)
        real_close(self)

    monkeypatch.setattr(bench.Engine, "open", opening)
    monkeypatch.setattr(bench.Engine, "close", closing)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc,single", "--tokens", "2", "--prompt-tokens",
                 "4", "--rounds", "1", "--device", "cpu", "--quality-positions", "4", "--json", str(out)]) == 0
    assert seen == [0] and live == []
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"inproc", "single"} and report["quality"]["positions"] == 4


def test_modes_that_fit_are_not_refused():
    bench.check_room_for_modes(4 * 2**30, ["inproc"], ["single", "split"], 9 * 2**30)  # 8 GiB of 0.9 x 9: fits
    bench.check_room_for_modes(40 * 2**30, ["inproc", "single"], [], 1)  # nothing left to open


def test_parameter_count_of_real_geometry():
    from coordinator.cli.make_model import PRESETS

    g = PRESETS["qwen3-30b-a3b"]()
    assert 30e9 < parameter_count("qwen3_moe", g) < 31.5e9  # Qwen3-30B-A3B has 30.5B parameters
    m = PRESETS["mixtral-8x7b"]()
    assert 46e9 < parameter_count("mixtral", m) < 47.5e9  # Mixtral 8x7B: 46.7B


@pytest.mark.slow
def test_plot_draws_a_png(report, tmp_path):
    pytest.importorskip("matplotlib")
    from coordinator.cli.bench import plot

    out = tmp_path / "r.png"
    plot(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("fmt, per_weight", [("bf16", 2.0), ("q4", 0.5625)])
def test_each_format_reports_its_stored_bytes_and_reads(tmp_path, fmt, per_weight):
    # 96 = 3 whole blocks: no slice's W_down rows are padded (80 would pad the last node's 16 to 32)
    model = make_model(tmp_path / "m", seed=2, moe_intermediate_size=96)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc,split", "--nodes", "2", "--tokens", "3",
                 "--prompt-tokens", "5", "--rounds", "1", "--expert-dtype", fmt, "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    for mode, m in modes.items():
        assert m["expert_format"] == fmt == m["experts"]["expert_format"], mode
        assert m["stored_bytes_per_weight"] == pytest.approx(per_weight, rel=0.05), mode  # 64-byte alignment aside
        assert m["bytes"]["counted"] == m["bytes"]["implied_by_routing"] > 0, mode


@pytest.mark.slow
def test_quality_against_f32_is_reported_for_the_formats(tmp_path):
    """q8 experts + q8 dense matrices against the f32 computation: figures that show the quantisation."""
    model = make_model(tmp_path / "m", seed=3)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc", "--tokens", "2", "--prompt-tokens", "4",
                 "--rounds", "1", "--expert-dtype", "q8", "--dense-dtype", "q8", "--device", "cpu",
                 "--quality-positions", "16", "--json", str(out)]) == 0
    q = json.loads(out.read_text())["quality"]
    assert (q["expert_format"], q["positions"]) == ("q8", 16)
    assert re.fullmatch(r"\d+ q8", q["dense_format"])  # every dense matrix in q8
    assert 0 < q["max_rel_logits_error"] < 0.05 and 0 < q["mean_kl"] < 1e-2 and q["top1_agreement"] >= 0.9
    p = q["prefill"]  # the same positions in one pass
    assert p["positions"] == 16 and 0 < p["max_rel_logits_error"] < 0.05 and 0 < p["mean_kl"] < 1e-2


@pytest.mark.slow
def test_speculative_decoding_is_reported_beside_plain_decoding(tmp_path, capsys):
    """--speculative ngram on a repetitive prompt: each round decodes with and without drafts, the order
    alternating; the speedup is the median of the rounds' own ratios, and drafts were made and counted."""
    model = make_model(tmp_path / "m", seed=2)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc", "--tokens", "24", "--prompt-tokens", "32",
                 "--rounds", "3", "--quality-positions", "0", "--speculative", "ngram", "--repetitive",
                 "--json", str(out)]) == 0
    m = json.loads(out.read_text())["modes"]["inproc"]
    sp = m["speculative"]
    plain, drafted = m["decode_tokens_per_s"]["values"], sp["decode_tokens_per_s"]["values"]
    assert len(plain) == len(drafted) == 3
    assert sp["speedup_by_round"] == pytest.approx([d / p for d, p in zip(drafted, plain)])
    assert sp["speedup"] == pytest.approx(sorted(sp["speedup_by_round"])[1])
    lo, hi = sp["speedup_quartiles"]  # 3 rounds: halfway from the least to the median, and from it to the most
    r = sorted(sp["speedup_by_round"])
    assert (lo, hi) == pytest.approx(((r[0] + r[1]) / 2, (r[1] + r[2]) / 2))
    assert sp["mode"] == "ngram" and sp["drafted_tokens"] > 0 and 0 <= sp["accepted_drafts"] <= sp["drafted_tokens"]
    assert sp["tokens_per_step"] >= 1
    assert re.search(r"inproc: with ngram drafts decode [\d.]+ tok/s, [\d.]+x without \(median of the rounds' "
                     rf"ratios, their middle half {lo:.2f}-{hi:.2f}\)", capsys.readouterr().out)


def test_a_prompt_file_is_the_rounds_prompt(tmp_path, monkeypatch):
    """--prompt-file: every round of every side prefills the file's first --prompt-tokens tokens (encoded with the
    model's tokenizer), not random ids; the report says the prompt is text and how long it is."""
    model = make_model(tmp_path / "m", seed=2)
    text = "def add(a, b):\n    return a + b\n" * 8
    (tmp_path / "p.py").write_text(text)
    prompts = []
    generate_full = bench.Engine.generate_full
    monkeypatch.setattr(bench.Engine, "generate_full",
                        lambda self, ids, *a, **k: prompts.append(list(ids)) or generate_full(self, ids, *a, **k))
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc", "--tokens", "3", "--prompt-tokens", "20",
                 "--rounds", "2", "--quality-positions", "0", "--speculative", "ngram", "--prompt-file",
                 str(tmp_path / "p.py"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    want = bench.Engine.open(model).encode(text)[:20]
    assert len(want) == 20 and report["prompt"] == "text" and report["prompt_tokens"] == 20
    # the warm-up, two rounds with and without drafts, the step split's profiled decode
    assert len(prompts) == 6 and all(p == want for p in prompts)


@pytest.mark.parametrize("name, text, extra, match", [
    ("empty.txt", "", [], "holds no text"),
    ("bad.bin", b"\xff\xfe\x00", [], "cannot be read"),
    ("p.txt", "some text", ["--repetitive"], "give one"),
])
def test_a_bad_prompt_file_is_refused_with_its_cause(tmp_path, capsys, name, text, extra, match):
    model = make_model(tmp_path / "m", seed=2)
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    assert main(["bench", "--model", str(model), "--modes", "inproc", "--tokens", "2", "--prompt-tokens", "4",
                 "--rounds", "1", "--quality-positions", "0", "--prompt-file", str(path), *extra]) != 0
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.slow
def test_formats_are_benched_side_by_side_with_ratios_to_the_first(tmp_path, capsys):
    """--formats opens each mode once per format (mode@format) in the same interleaved rounds: each engine
    stores what its entry asks (FORMAT for both, EXPERTS+DENSE apart), the ratios are to the same mode in the
    first format, vs inproc is to inproc in the same format, and quality is measured for each format."""
    model = make_model(tmp_path / "m", seed=2, moe_intermediate_size=96)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc,single", "--formats", "f32,bf16,q8+bf16",
                 "--tokens", "3", "--prompt-tokens", "5", "--rounds", "2", "--device", "cpu",
                 "--quality-positions", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["formats"] == ["f32", "bf16", "q8+bf16"]
    assert report["kernels"].startswith("kernels compiled for the host's: ")  # no NUMBA_CPU_NAME here
    assert list(report["modes"]) == ["inproc@f32", "inproc@bf16", "inproc@q8+bf16",
                                     "single@f32", "single@bf16", "single@q8+bf16"]
    stored = {"f32": ("f32", r"\d+ f32"), "bf16": ("bf16", r"\d+ bf16"), "q8+bf16": ("q8", r"\d+ bf16")}
    for label, m in report["modes"].items():
        mode, fmt = label.split("@")
        assert m["mode"] == mode and m["decode_tokens_per_s"]["n"] == 2
        assert m["expert_format"] == stored[fmt][0], label
        assert re.fullmatch(stored[fmt][1], m["dense_format"]), label  # every dense matrix in the format
        first, inproc = report["modes"][f"{mode}@f32"], report["modes"][f"inproc@{fmt}"]
        r = m["vs_first_format"]
        assert r["of"] == f"{mode}@f32"
        assert r["decode"] == pytest.approx(m["decode_tokens_per_s"]["median"] / first["decode_tokens_per_s"]["median"])
        assert r["prefill"] == pytest.approx(m["prefill_tokens_per_s"]["median"]
                                             / first["prefill_tokens_per_s"]["median"])
        assert m["decode_vs_inproc"] == pytest.approx(m["decode_tokens_per_s"]["median"]
                                                      / inproc["decode_tokens_per_s"]["median"])
    q = report["quality_by_format"]
    assert list(q) == ["inproc@f32", "inproc@bf16", "inproc@q8+bf16"] and report["quality"] == q["inproc@f32"]
    assert q["inproc@f32"]["mean_kl"] == 0 and q["inproc@bf16"]["mean_kl"] > 0  # an f32 checkpoint: bf16 rounds
    assert q["inproc@q8+bf16"]["expert_format"] == "q8" and q["inproc@q8+bf16"]["positions"] == 6
    text = capsys.readouterr().out
    assert re.search(r"single@bf16: decode \d+\.\d\dx and prefill \d+\.\d\dx single@f32", text)
    assert report["kernels"] in text


@pytest.mark.parametrize("argv, match", [
    (["--formats", "f32,fp7"], "'fp7' is not a format"),
    (["--formats", "q4k"], "'q4k' is not a format"),  # a GGUF file's blocks are for experts only: q4k+q8
    (["--formats", "bf16,bf16"], "'bf16' is given twice"),
    (["--formats", "f32,bf16", "--expert-dtype", "q8"], "without --expert-dtype"),
])
def test_bad_formats_are_refused_before_any_engine_opens(tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.setattr(bench.Engine, "open", lambda *a, **k: pytest.fail("an engine opened"))
    assert main(["bench", "--model", str(tmp_path), "--modes", "inproc", *argv]) == 2
    assert match in capsys.readouterr().err
