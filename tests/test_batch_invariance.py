"""A row's result does not depend on the rows beside it (issue 62): one sequence's logits decoded alone, in a
batch of 3 or 8 sequences, with 1 to 4 drafts (several rows of it at once) and prefilled in chunks of 1, 7 and
64 tokens, bit for bit, in every storage format (a safetensors model's experts and dense matrices as f32, bf16,
q8 or q4; GGUF files llama.cpp's converter and llama-quantize made: K types, Q8_0, IQ4_XS), every activation mode,
every family's attention (GQA, gated, MLA, the Gated DeltaNet), the host's hot experts, and every pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from invariance import A, OTHERS, alone, chunked, every_step_shape, unequal

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
ACTIVATIONS = ("q8", "bf16", "f32")
FORMATS = ("f32", "bf16", "q8", "q4")  # a safetensors model's, experts and dense matrices alike
FILES = ("qwen3_moe_quant-Q4_K_M", "qwen3_moe_quant-Q8_0", "qwen3_moe_quant-IQ4_XS")  # llama-quantize's


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A Qwen2-MoE safetensors model (a shared expert and its gate beside the routed ones), 64 wide: whole blocks
    of 32 for q8 and q4."""
    return make_model(tmp_path_factory.mktemp("inv") / "qwen2", arch="qwen2_moe", seed=3)


def check(path: Path, n: int = len(A), **settings) -> None:
    """A's logits in every step shape are its logits alone, to the last bit, in-process."""
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", **settings)) as eng:
        want = alone(eng, n)
        got = every_step_shape(eng, n)
    assert np.abs(want).max() > 0 and len({w.argmax() for w in want}) > 1
    assert {how: unequal(logits, want) for how, logits in got.items()} == {how: [] for how in got}


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_and_activation_mode_of_a_safetensors_model(model, fmt, activations):
    check(model, expert_dtype=fmt, dense_dtype=fmt, activations=activations)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("name", FILES)
def test_every_activation_mode_on_llama_quantize_files(name, activations):
    check(FIXTURES / f"{name}.gguf", activations=activations)


@pytest.mark.parametrize("name", ["mixtral_quant-Q4_K_M", "qwen2_moe_quant-Q8_0", "glm4_moe_quant-IQ4_XS",
                                  "deepseek_v3_quant-Q8_0", "qwen3_next_quant-Q4_K_M"])
def test_every_familys_attention(name):
    """Mixtral's, GLM-4.5's (the sigmoid router's groups), DeepSeek's MLA (absorbed, a row at a time over the keys
    it sees) and Qwen3-Next's gated attention and Gated DeltaNet (a token at a time)."""
    check(FIXTURES / f"{name}.gguf", n=40 if name.startswith("qwen3_next") else len(A))


def test_the_hosts_hot_experts(model):
    """Experts kept whole on the device side (NumPy's hot experts), beside the pool's."""
    check(model, gpu_experts=3)


def test_without_invariance_a_chunked_prompt_takes_other_sums():
    """--no-batch-invariant gives the chunked Gated DeltaNet back to prompts of 16 tokens or more: their rows then
    differ from decode's (what the tests above would catch)."""
    path = FIXTURES / "qwen3_next_quant-Q4_K_M.gguf"
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", batch_invariant=False)) as eng:
        assert unequal(chunked(eng, 64, 40), alone(eng, 40)) != []


@pytest.mark.slow
@pytest.mark.usefixtures("dev_shm_alone")  # its 42 starts clean dead owners' pool folders: not beside a SIGKILL test
@pytest.mark.parametrize("pool", ["single", "split"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("name", FILES + tuple(f"safetensors-{fmt}" for fmt in FORMATS))
def test_the_same_bits_through_the_node_workers(model, name, activations, pool):
    """The process pool's workers (one, or two virtual nodes each holding half of every expert's rows, their
    partials added in node order) give a row the same bits in any step, and the in-process pool's bits."""
    if name.startswith("safetensors-"):
        fmt = name.split("-")[1]
        path, settings = model, dict(expert_dtype=fmt, dense_dtype=fmt, activations=activations)
    else:
        path, settings = FIXTURES / f"{name}.gguf", dict(activations=activations)
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", **settings)) as eng:
        inproc = alone(eng)
    split = dict(numa_split=True, nodes=2) if pool == "split" else dict(nodes=1)
    with Engine.open(path, EngineConfig(pool="process", device="cpu", **split, **settings)) as eng:
        want = alone(eng)
        got = every_step_shape(eng)
    if pool == "single":
        assert unequal(want, inproc) == []
    assert {how: unequal(logits, want) for how, logits in got.items()} == {how: [] for how in got}


@pytest.mark.slow
def test_a_served_request_gets_the_same_greedy_answer_alone_and_among_8(tmp_path):
    """`strata serve` on a Q4_K_M file: a greedy request's answer sent alone, and its tokens' log-probabilities to
    the last bit, are what it gets among 8 concurrent ones (each stream open before any goes on: the server
    steps them together)."""
    import threading

    import openai
    from served import start_server, stop_server

    s = start_server(FIXTURES / "qwen3_moe_quant-Q4_K_M.gguf", tmp_path, "--http", "127.0.0.1:0")
    try:
        client = openai.OpenAI(base_url=s.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [[int(t) for t in A[:6]]] + [[int(t) for t in ids] for ids in OTHERS]  # 8, A's first

        def ask(prompt: list[int], stream: bool = False, started: threading.Barrier | None = None) -> tuple:
            """(the text, each token's log-probability)."""
            r = client.completions.create(model="qwen3_moe_quant-Q4_K_M.gguf", prompt=prompt, max_tokens=40,
                                          temperature=0, logprobs=1, stream=stream)
            if not stream:
                return r.choices[0].text, tuple(r.choices[0].logprobs.token_logprobs)
            pieces, logprobs = [], []
            for n, chunk in enumerate(r):
                pieces.append(chunk.choices[0].text)
                if chunk.choices[0].logprobs is not None:
                    logprobs += chunk.choices[0].logprobs.token_logprobs
                if n == 0 and started is not None:
                    started.wait()  # every stream open before any goes on
            return "".join(pieces), tuple(logprobs)

        alone = ask(prompts[0])
        answers: list = [None] * len(prompts)
        started = threading.Barrier(len(prompts), timeout=120)

        def run(i: int) -> None:
            try:
                answers[i] = ask(prompts[i], stream=True, started=started)
            except BaseException as exc:  # noqa: BLE001 - checked below, in the test's thread
                started.abort()
                answers[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        assert stop_server(s) == 0, s.stderr()
    assert all(isinstance(a, tuple) for a in answers), answers
    assert alone[0] and len(alone[1]) == 40 and answers[0] == alone
    assert len({text for text, _ in answers}) > 1  # the others asked other things
