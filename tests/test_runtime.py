"""Speculative decoding runtime: target-forward parity with HF, greedy losslessness, KV rollback,
batching, sampling distribution, adaptive depth, n-gram lookup, bad input.

Tiny random targets run in float64 so that "speculative == plain greedy" is exact (no near-tie argmax
flips from summation order). The oracle drafter copies the target, so every draft must be accepted.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from drafthead import hardware
from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.family import OwnLayers
from drafthead.layers import kv_cache
from drafthead.kernels import cpu_linear, extension, hugepages, packing, probe
from drafthead.runtime import GenerationResult, SpecConfig, SpeculativeGenerator, TargetModel
from drafthead.kernels import verify as ops  # Triton on CUDA, the eager reference elsewhere
from drafthead.runtime.draft import CHAIN, TREE, ngram_lookup
from drafthead.runtime.generate import _Request, _Session
from drafthead.runtime.sampling import probs
from drafthead.target import Target, freeze
from drafthead.vocab import build_vocab_mapping


def kernel_paths() -> list[str]:
    """The bf16 kernel's tile paths this CPU has ("none" where it has no AVX512-BF16): each is run forced."""
    return probe.cpu_paths() if hardware.cpu_class() in hardware.NATIVE_BF16_CLASSES else ["none"]


@contextlib.contextmanager
def forced_path(path: str):
    if path == "none" or not extension.available("bf16"):
        yield
        return
    with probe.use(probe.Setting(path=path, hint="t0", ahead=32)):
        yield


EOS = 2
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
         "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_target(arch: str = "llama", vocab: int = 128, seed: int = 0, dtype=torch.float64, head_scale: float = 1.0,
                **kw) -> Target:
    cfg_cls, model_cls = ARCHS[arch]
    args = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
                tie_word_embeddings=False)
    cfg = cfg_cls(**{**args, **kw})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval().to(dtype)
    with torch.no_grad():  # sharper next-token distributions than the near-uniform random init
        model.lm_head.weight.mul_(head_scale)
    return freeze(Target(model, None, f"tiny-{arch}"))


def random_drafter(target: Target, seed: int = 1, draft_vocab: int | None = None) -> Eagle3Drafter:
    tcfg = target.config
    n = draft_vocab or tcfg.vocab_size // 2
    torch.manual_seed(seed)
    d = Eagle3Drafter(Eagle3Config.from_target(tcfg, draft_vocab_size=n, aux_layer_ids=[0, 1, 1]))
    d = d.to(target.model.dtype)
    d.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight)
    d2t, t2d = build_vocab_mapping(torch.arange(tcfg.vocab_size).flip(0), n)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    return d


class OracleDrafter(OwnLayers, nn.Module):
    """A drafter that predicts exactly what the target predicts (for always-accept checks).

    It speaks the `Eagle3Drafter` inference API. Its "KV" entries store (x_{t+1}, x_t or -1): x_t is read
    back from the fused feature f_t, which with aux layer 0 is the target's token embedding. For each query
    it rebuilds the visible token sequence from the attention mask and runs the target on it.
    """

    family, features, draft_modes = "oracle", "aux", {"chain": CHAIN, "tree": TREE}  # the `Drafter` protocol

    def capture_layer_ids(self) -> list[int]:
        return [0]

    def check_target(self, tcfg) -> list[str]:
        return []

    def draft_state(self, batch: int, capacity: int, device: torch.device):
        from drafthead.runtime.draft import DraftRunner

        return DraftRunner(self, batch, capacity, device)

    def __init__(self, target: Target, one_hot: bool = False) -> None:
        super().__init__()
        c = target.config
        self.target = target.model
        self.one_hot = one_hot  # logits = large margin on the argmax, so tree scores follow the greedy path
        self.config = SimpleNamespace(aux_layer_ids=[0], target_hidden_size=c.hidden_size, hidden_size=c.hidden_size,
                                      vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, num_key_value_heads=1,
                                      head_dim=2)
        self.register_buffer("d2t", torch.zeros(c.vocab_size, dtype=torch.long))
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.d2t[idx]

    def next_logits(self, seq: tuple[int, ...]) -> torch.Tensor:
        if seq not in self.memo:
            logits = self.target(torch.tensor([seq])).logits[0, -1]
            if self.one_hot:
                logits = 50.0 * torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).to(logits.dtype)
            self.memo[seq] = logits
        return self.memo[seq]

    def decode(self, input_ids, hidden, positions, kv=None, attn_mask=None, logits_at=None):
        B, T = input_ids.shape
        emb = self.target.get_input_embeddings().weight  # [V, H]
        match = (hidden[:, :, None, :] == emb[None, None]).all(-1)  # [B, T, V]
        prev = torch.where(match.any(-1), match.float().argmax(-1), -1)  # [B, T] x_t when hidden is f_t
        new = torch.stack([input_ids, prev], dim=-1)[:, None].to(emb.dtype)  # [B, 1, T, 2] an entry's key
        cache, attn_mask = kv_cache(kv, new, new, attn_mask)  # [B, 2, S, 2]
        attn_mask = attn_mask.expand(B, 1, T, cache.shape[2])
        logits = torch.zeros(B, T, emb.shape[0], dtype=emb.dtype)
        for b, i in itertools.product(range(B), range(T)):
            vis = attn_mask[b, 0, i].nonzero()[:, 0]
            first = int(cache[b, 0, vis[0], 1])
            if first < 0:  # a padding query: any answer will do
                continue
            seq = (first,) + tuple(int(t) for t in cache[b, 0, vis, 0])
            logits[b, i] = self.next_logits(seq)
        if logits_at is not None:
            logits = logits[torch.arange(B), logits_at][:, None]
        return logits, torch.zeros_like(hidden), cache


def reference_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with full HF forwards (no cache), stopping after EOS."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == EOS:
                break
    return out


def random_prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(lo, hi, (1,), generator=g))
        p = torch.randint(3, vocab, (L,), generator=g).tolist()
        if i % 3 == 2:  # a repeated span gives prompt lookup something to find
            p = p + p[: max(1, L // 2)]
        out.append(p)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are op-overhead bound; extra threads only spin on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama() -> Target:
    return tiny_target("llama")


@pytest.fixture(scope="module")
def qwen3() -> Target:
    return tiny_target("qwen3", seed=3)


# ---- target forward parity ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_target_forward_matches_hf(arch: str) -> None:
    target = tiny_target(arch, dtype=torch.float32, seed=5)
    m = target.model
    tm = TargetModel(m, aux_layer_ids=[1, 0])
    torch.manual_seed(0)
    seq = torch.randint(0, 128, (2, 14))
    with torch.no_grad():
        ref = m(seq, output_hidden_states=True)
    cache = tm.new_cache(2, 32)
    lens = torch.zeros(2, dtype=torch.long)
    # ragged prefill: request 0 gets 9 tokens, request 1 gets 6
    plen = torch.tensor([9, 6])
    logits, aux = tm.forward(cache, seq[:, :9], lens, capture=True)
    torch.testing.assert_close(logits[0], ref.logits[0, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :6], ref.logits[1, :6], atol=1e-5, rtol=1e-5)
    want_aux = torch.cat([ref.hidden_states[1], ref.hidden_states[0]], dim=-1)
    torch.testing.assert_close(aux[0], want_aux[0, :9], atol=1e-5, rtol=1e-5)
    # one decode step at different lengths
    lens = plen.clone()
    step = torch.stack([seq[0, 9:10], seq[1, 6:7]])
    logits, _ = tm.forward(cache, step, lens)
    torch.testing.assert_close(logits[0, 0], ref.logits[0, 9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, 0], ref.logits[1, 6], atol=1e-5, rtol=1e-5)
    lens += 1
    # a tree verify: root + two branches; node logits equal HF on the root-to-node sequence
    tokens = torch.tensor([[5, 7, 9, 11, 13], [21, 23, 25, 27, 29]])
    parents = torch.tensor([[-1, 0, 1, 0, 3], [-1, 0, 0, 2, 2]])
    mask, depth = ops.build_tree_mask(parents, torch.tensor([5, 5]))
    logits, _ = tm.forward(cache, tokens, lens, tree_mask=mask, depth=depth)
    for b in range(2):
        prefix = seq[b, : int(lens[b])].tolist()
        for i in range(5):
            path, j = [], i
            while j >= 0:
                path.insert(0, int(tokens[b, j]))
                j = int(parents[b, j])
            with torch.no_grad():
                want = m(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(logits[b, i], want, atol=1e-5, rtol=1e-5)


def test_target_forward_rejects_unsupported() -> None:
    target = tiny_target("llama")
    target.model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        TargetModel(target.model)
    target.model.config.model_type = "llama"


# ---- greedy losslessness ------------------------------------------------------------------------
SETTINGS = [
    *[SpecConfig(mode="chain", num_speculative_tokens=k) for k in range(1, 6)],
    SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6, topk=2),
    SpecConfig(mode="tree", num_speculative_tokens=4, tree_nodes=10, topk=3, batch_size=3),
    SpecConfig(mode="chain", num_speculative_tokens=4, adaptive=True, batch_size=2),
    SpecConfig(mode="tree", num_speculative_tokens=4, tree_nodes=8, topk=2, adaptive=True, batch_size=2),
    SpecConfig(mode="ngram", num_speculative_tokens=4, batch_size=3),
    SpecConfig(mode="chain", num_speculative_tokens=3, ngram=True, batch_size=3),
    SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6, topk=2, ngram=True, adaptive=True),
    SpecConfig(mode="ar", batch_size=3),
]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter_kind", ["random", "oracle"])
def test_greedy_is_lossless(arch: str, drafter_kind: str, llama: Target, qwen3: Target) -> None:
    target = llama if arch == "llama" else qwen3
    drafter = random_drafter(target) if drafter_kind == "random" else OracleDrafter(target, one_hot=True)
    gen = SpeculativeGenerator(target, drafter)
    prompts = random_prompts(4, 128, seed=len(arch) + len(drafter_kind))
    want = [reference_greedy(target, p, 20) for p in prompts]
    for spec in SETTINGS:
        got = gen.generate(prompts, 20, spec)
        assert [r.tokens for r in got] == want, spec
        for r in got:
            assert len(r.accept_lens) == len(r.num_drafted) == r.num_rounds
            assert len(r.tokens) <= 1 + sum(r.accept_lens) + r.num_rounds
            assert r.stopped_eos == (r.tokens[-1] == EOS)


def forward_in_blocks(tm: TargetModel, prefix: torch.Tensor, new: torch.Tensor, sizes: list[int], capacity: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `prefix` [B, P], then feed `new` [B, T] in blocks of `sizes` tokens (a verify block or single
    decode steps); returns the logits [B, T, V] and aux features [B, T, F] of all new tokens."""
    B = prefix.shape[0]
    cache, lens = tm.new_cache(B, capacity), torch.zeros(B, dtype=torch.long)
    tm.forward(cache, prefix, lens, prefill=True)
    lens, out, i = lens + prefix.shape[1], [], 0
    for n in sizes:
        out.append(tm.forward(cache, new[:, i: i + n], lens, capture=True))
        lens, i = lens + n, i + n
    return torch.cat([o[0] for o in out], 1), torch.cat([o[1] for o in out], 1)


@pytest.mark.parametrize("path", kernel_paths())
def test_bf16_verify_block_is_bitwise_single_steps(path: str) -> None:
    """Batch invariance in bf16: a token's logits are the same bits whether it is decoded alone or inside
    a verify block of any size, so greedy speculative output can equal AR output exactly (on each tile path the
    kernel probe can pick here)."""
    with forced_path(path):
        _bf16_verify_block_is_bitwise_single_steps()


def _bf16_verify_block_is_bitwise_single_steps() -> None:
    target = tiny_target("llama", dtype=torch.bfloat16, seed=9, hidden_size=64, intermediate_size=128)
    tm = TargetModel(target.model, aux_layer_ids=[0, 1, 1])
    g = torch.Generator().manual_seed(0)
    # up to 40 tokens x 2 rows a call: every tile path of the bf16 kernel (one tile, two sharing K chunks, many)
    prefix, new = torch.randint(3, 128, (2, 11), generator=g), torch.randint(3, 128, (2, 40), generator=g)
    logits, aux = forward_in_blocks(tm, prefix, new, [1] * 40, 60)
    for sizes in ([40], [2, 3, 4, 31], [5, 1, 3, 7, 24], [12, 16, 12]):
        lg, ax = forward_in_blocks(tm, prefix, new, sizes, 60)
        assert torch.equal(lg, logits), sizes
        assert torch.equal(ax, aux), sizes


def test_bf16_projections_are_row_invariant_beyond_32_rows() -> None:
    """oneDNN's bf16 matmul changes a row's bits once a call has more than 32 rows (SmolLM2's [1536, 576]
    MLP shape here), e.g. a batch of 4 verifying 10 nodes; `TargetModel.linear` chunks rows so that each
    row equals the row computed alone. The tiny test models above never reach that size."""
    from drafthead.runtime.model import INVARIANT_ROWS

    tm = TargetModel(tiny_target("llama", dtype=torch.bfloat16).model)
    torch.manual_seed(0)
    proj = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 25, 576).to(torch.bfloat16)  # [B, T, H]: 100 rows
    with torch.no_grad():
        single = torch.cat([proj(x.reshape(100, 576)[i: i + 1]) for i in range(100)]).view(4, 25, -1)
        for T in (8, 9, 10, 25):  # 32, 36, 40, 100 rows
            assert torch.equal(tm.linear(proj, x[:, :T], prefill=True), single[:, :T]), T
        raw = proj(x[:, :10])
    assert INVARIANT_ROWS == 32
    if torch.equal(raw, single[:, :10]):  # AMD EPYC (AVX512-BF16): nothing to guard against there
        pytest.skip("oneDNN's bf16 matmul is row-invariant at 40 rows on this CPU: the case cannot fail here")


@pytest.mark.skipif(not extension.available(), reason="bf16 CPU kernel unavailable")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_decode_kernel_is_close_to_hf_and_lossless(arch: str) -> None:
    """bf16 TargetModel: decode-step logits (packed kernel) are close to HF's bf16 forward, and greedy
    speculative output equals AR output with the kernel on and with it off (oneDNN fallback)."""
    target = tiny_target(arch, dtype=torch.bfloat16, seed=3, head_scale=4.0)
    tm = TargetModel(target.model)
    assert tm.decode_kernel
    seq = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    cache, lens = tm.new_cache(1, 16), torch.zeros(1, dtype=torch.long)
    tm.forward(cache, seq[:, :8], lens, prefill=True)
    logits, _ = tm.forward(cache, seq[:, 8:], lens + 8)  # [1, 4, V] through the packed kernel
    with torch.no_grad():
        hf = target.model(seq).logits[:, 8:].float()  # [1, 4, V]
    assert (logits.float() - hf).abs().max() < 0.05 * hf.abs().max(), "decode kernel far from HF"
    assert isinstance(tm.model.model.layers[0].mlp.down_proj, nn.Linear)

    prompts = random_prompts(3, 128, seed=5)
    for on in (True, False):
        gen = SpeculativeGenerator(target, random_drafter(target))
        gen.model.decode_kernel = on
        want = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
        for spec in (SpecConfig(mode="chain", num_speculative_tokens=3),
                     SpecConfig(mode="chain", num_speculative_tokens=2, ngram=True),
                     SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6)):
            assert [r.tokens for r in gen.generate(prompts, 16, spec)] == want, (on, spec)


@pytest.mark.skipif(not extension.available("fp32"), reason="fp32 CPU kernel unavailable")
@pytest.mark.parametrize("arch,weights", [("llama", None), ("qwen3", None), ("llama", "bf16"), ("qwen2", "int8")])
def test_fp32_decode_kernel_is_lossless_bit_for_bit(arch: str, weights: str | None) -> None:
    """fp32 TargetModel on CPU: generated tokens go through the fp32 kernel (weights as loaded, or compressed to
    bf16 / int8), their logits are close to HF's forward of the same (rounded) weights, and greedy speculative
    output equals AR output token for token in chain, chain + n-gram, tree and n-gram modes."""
    target = tiny_target(arch, dtype=torch.float32, seed=3, head_scale=4.0)
    gen = SpeculativeGenerator(target, random_drafter(target), weights=weights)
    tm = gen.model
    assert tm.decode_kernel and tm.kernel == "fp32" and tm.weights == (weights or "fp32")
    if weights:  # the model's own weights now hold the values the compressed ones stand for
        w = tm.layers[0].mlp.up_proj.weight  # [I, H]
        if weights == "bf16":
            assert torch.equal(w.to(torch.bfloat16).float(), w)
        else:  # int8: each output row holds at most 255 levels
            assert max(len(row.unique()) for row in w) <= 255
    seq = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    cache, lens = tm.new_cache(1, 16), torch.zeros(1, dtype=torch.long)
    tm.forward(cache, seq[:, :8], lens, prefill=True)
    logits, _ = tm.forward(cache, seq[:, 8:], lens + 8)  # [1, 4, V] through the kernel
    with torch.no_grad():
        hf = target.model(seq).logits[:, 8:]  # [1, 4, V]
    assert torch.allclose(logits, hf, rtol=1e-4, atol=1e-4 * float(hf.abs().max()))
    prompts = random_prompts(3, 128, seed=5)
    want = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
    for spec in (SpecConfig(mode="chain", num_speculative_tokens=3),
                 SpecConfig(mode="chain", num_speculative_tokens=2, ngram=True),
                 SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6),
                 SpecConfig(mode="ngram", num_speculative_tokens=3),
                 SpecConfig(mode="chain", num_speculative_tokens=3, batch_size=3)):
        assert [r.tokens for r in gen.generate(prompts, 16, spec)] == want, spec


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)])
def test_joined_decode_groups_give_the_bits_of_separate_projections(arch: str, dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated tokens run q/k/v and gate/up as one packed weight each: the logits equal those of a runtime
    that runs every projection on its own, bit for bit (Qwen2: with the q/k/v biases)."""
    kind = cpu_linear.kind_for(dtype)
    if not extension.available(kind):
        pytest.skip(f"{kind} CPU kernel unavailable: {extension.unavailable_reason(kind)}")
    target = tiny_target(arch, dtype=dtype, seed=3)
    seq = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))

    def decode(tm: TargetModel) -> torch.Tensor:
        cache, lens = tm.new_cache(1, 16), torch.zeros(1, dtype=torch.long)
        tm.forward(cache, seq[:, :8], lens, prefill=True)
        return tm.forward(cache, seq[:, 8:], lens + 8)[0]  # [1, 4, V]

    joined = TargetModel(target.model)
    got = decode(joined)
    a, m = joined.layers[0].self_attn, joined.layers[0].mlp
    assert joined.packed(a.q_proj, a.k_proj, a.v_proj) is not None and joined.packed(m.gate_proj, m.up_proj) is not None
    monkeypatch.setattr(packing, "can_concat", lambda parts: False)
    apart = TargetModel(target.model)
    assert torch.equal(decode(apart), got)
    assert apart.packed(a.q_proj, a.k_proj, a.v_proj) is None and apart.streamed_bytes() == joined.streamed_bytes()


@pytest.mark.parametrize("arch,dtype,weights", [("llama", torch.float32, None), ("qwen2", torch.float32, "int8"),
                                                 ("qwen3", torch.float32, "bf16"), ("llama", torch.bfloat16, None),
                                                 ("qwen2", torch.bfloat16, None), ("qwen3", torch.bfloat16, None)])
def test_one_call_layers_give_the_bits_of_op_by_op_layers(arch: str, dtype: torch.dtype, weights: str | None) -> None:
    """Generated tokens run each decoder layer in one call (`packing.decode_layer`): logits, captured features
    and the KV cache equal those of the op-by-op layer, bit for bit, for a lone token, a causal block and a tree
    block, with two requests at different lengths (Qwen2: q/k/v biases; Qwen3: q/k norms)."""
    kind = cpu_linear.kind_for(dtype)
    if not (extension.available(kind) and extension.available("fp32")):
        pytest.skip(f"CPU kernels unavailable: "
                    f"{extension.unavailable_reason(kind) or extension.unavailable_reason('fp32')}")
    target = tiny_target(arch, dtype=dtype, seed=4, head_dim=16, num_attention_heads=6, num_key_value_heads=2,
                         hidden_size=48, intermediate_size=96)
    g = torch.Generator().manual_seed(2)
    prompt, new = torch.randint(3, 128, (2, 9), generator=g), torch.randint(3, 128, (2, 4), generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])

    def steps(tm: TargetModel) -> list[torch.Tensor]:
        cache, lens = tm.new_cache(2, 24), torch.tensor([9, 6])  # the second request's prompt is shorter
        tm.forward(cache, prompt, torch.zeros(2, dtype=torch.long), prefill=True)
        out = [tm.forward(cache, new[:, :1], lens, capture=True)[0]]
        lens = lens + 1
        logits, aux = tm.forward(cache, new, lens, capture=True)
        out += [logits, aux]
        lens = lens + 4
        out.append(tm.forward(cache, new, lens, tree_mask=tree.expand(2, 4, 4), depth=depth.expand(2, 4))[0])
        return out + [cache]

    fused = TargetModel(target.model, aux_layer_ids=[0, 1], weights=weights)
    assert fused.fused
    got = steps(fused)
    assert all(fused._fused[i] is not None for i in range(fused.num_layers))
    apart = TargetModel(target.model, aux_layer_ids=[0, 1], weights=weights)
    apart.fused = False
    want = steps(apart)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_one_call_layer_bad_inputs_are_named_errors() -> None:
    if not extension.available("fp32"):
        pytest.skip(f"fp32 CPU kernel unavailable: {extension.unavailable_reason('fp32')}")
    tm = TargetModel(tiny_target("llama", dtype=torch.float32, head_dim=16, num_attention_heads=2).model)
    step = tm.fused_layer(0, tm.layers[0])
    cache, h = tm.new_cache(1, 8), torch.zeros(1, 1, 32)
    cos = sin = torch.zeros(1, 1, 16)
    mask, slots = torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.tensor([[3]])
    assert step.forward(h, cos, sin, cache, slots, mask).shape == (1, 1, 32)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        step.forward(h, cos, sin, cache, torch.tensor([[8]]), mask)
    with pytest.raises(RuntimeError, match="h must be"):
        step.forward(h.double(), cos, sin, cache, slots, mask)
    with pytest.raises(RuntimeError, match="mask must be a bool"):
        step.forward(h, cos, sin, cache, slots, mask[..., :7])
    with pytest.raises(RuntimeError, match="cos and sin"):
        step.forward(h, cos[..., :8], sin[..., :8], cache, slots, mask)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        step.forward(h, cos, sin, cache, slots.int(), mask)
    with pytest.raises(RuntimeError, match="cache must be a contiguous"):
        step.forward(h, cos, sin, cache.transpose(2, 3).contiguous().transpose(2, 3), slots, mask)
    a, layer = tm.layers[0].self_attn, tm.layers[0]
    qkv, o = tm.packed(a.q_proj, a.k_proj, a.v_proj), tm.packed(a.o_proj)
    gate_up, down = tm.packed(layer.mlp.gate_proj, layer.mlp.up_proj), tm.packed(layer.mlp.down_proj)
    ext = extension.ext("fp32")
    norm = layer.input_layernorm.weight.detach()

    def make(qkv_args=None, q_norm=None, k_norm=None, capsule=None, norms=norm):
        def args(p):
            return p.packed, p.out_features, p.scale, p.bias
        return ext.DecodeLayer(0, 2, 2, 16, 0.25, norms, 1e-5, norms, 1e-5, q_norm, k_norm, 1e-5,
                               qkv_args or args(qkv), args(o), args(gate_up), args(down), capsule, False)

    assert make() is not None
    with pytest.raises(RuntimeError, match="int8 weights need a per-output scale"):
        make(qkv_args=(qkv.packed.to(torch.int8), qkv.out_features, None, None))
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        make(qkv_args=(qkv.packed, qkv.out_features, None, torch.zeros(3)))
    with pytest.raises(RuntimeError, match="more than its packed weight holds"):
        make(qkv_args=(qkv.packed, qkv.packed.shape[0] * 8 + 1, None, None))
    with pytest.raises(RuntimeError, match="q_norm without k_norm"):
        make(q_norm=torch.ones(16))
    if extension.available("bf16"):  # a bf16 layer needs the bf16 kernel's weights and its capsule
        with pytest.raises(RuntimeError, match="packed by its dtype's kernel"):
            make(norms=norm.bfloat16(), capsule=extension.ext("bf16").LINEAR)
        bq = packing.PackedLinear(nn.Linear(32, 96, bias=False).bfloat16())
        bo = packing.PackedLinear(nn.Linear(32, 32, bias=False).bfloat16())
        bgu = packing.PackedLinear(nn.Linear(32, 128, bias=False).bfloat16())
        bd = packing.PackedLinear(nn.Linear(64, 32, bias=False).bfloat16())

        def make_bf16(capsule):
            return ext.DecodeLayer(0, 2, 2, 16, 0.25, norm.bfloat16(), 1e-5, norm.bfloat16(), 1e-5, None, None, 0.0,
                                   *[(p.packed, p.out_features, None, None) for p in (bq, bo, bgu, bd)], capsule, True)

        assert make_bf16(extension.ext("bf16").LINEAR) is not None
        with pytest.raises(RuntimeError, match="need the bf16 extension's LINEAR capsule"):
            make_bf16(None)
        import ctypes
        other = ctypes.pythonapi.PyCapsule_New
        other.restype, other.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        with pytest.raises(RuntimeError, match="capsule is not drafthead.bf16_linear"):
            make_bf16(other(1, b"something.else", None))
    # without an input norm (a draft layer): forward_input(x, residual, ..) only, x as wide as q/k/v's input
    # given x = input_norm(h) and residual h it is the layer's forward, bit for bit
    post = layer.post_attention_layernorm
    bare = ext.DecodeLayer(0, 2, 2, 16, a.scaling, None, 0.0, post.weight.detach(), post.variance_epsilon, None, None,
                           0.0, *[(p.packed, p.out_features, p.scale, p.bias) for p in (qkv, o, gate_up, down)],
                           None, False)
    h1 = torch.randn(1, 1, 32)
    step_x = cpu_linear.rms_norm(h1, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    got_cache, want_cache = cache.clone(), cache.clone()
    got = bare.forward_input(step_x, h1, cos + 1, sin, got_cache, slots, mask)
    assert torch.equal(got, step.forward(h1, cos + 1, sin, want_cache, slots, mask))
    assert torch.equal(got_cache, want_cache) and got_cache.abs().sum() > 0
    with pytest.raises(RuntimeError, match="the two norms differ in size"):
        ext.DecodeLayer(0, 2, 2, 16, 0.25, torch.ones(16), 1e-5, norm, 1e-5, None, None, 0.0,
                        *[(p.packed, p.out_features, p.scale, p.bias) for p in (qkv, o, gate_up, down)], None, False)
    with pytest.raises(RuntimeError, match="runs by forward_input"):
        bare.forward(h, cos, sin, cache, slots, mask)
    with pytest.raises(RuntimeError, match="x must be"):
        bare.forward_input(torch.zeros(1, 1, 64), h, cos, sin, cache, slots, mask)
    with pytest.raises(RuntimeError, match="residual must be"):
        bare.forward_input(step_x, torch.zeros(1, 1, 16), cos, sin, cache, slots, mask)
    with pytest.raises(RuntimeError, match="cos and sin"):
        bare.forward_input(step_x, h, cos.double(), sin.double(), cache, slots, mask)
    with pytest.raises(RuntimeError, match="do not make one layer"):  # o where q/k/v belongs
        packing.decode_layer(0, 2, 2, 16, 0.25, tm.layers[0].input_layernorm, tm.layers[0].post_attention_layernorm,
                                tm.packed(a.o_proj), tm.packed(a.o_proj),
                                tm.packed(tm.layers[0].mlp.gate_proj, tm.layers[0].mlp.up_proj),
                                tm.packed(tm.layers[0].mlp.down_proj))


def test_compressed_weights_need_the_fp32_kernel() -> None:
    with pytest.raises(ValueError, match="weights=int8 needs an fp32 target .*bfloat16"):
        TargetModel(tiny_target("llama", dtype=torch.bfloat16).model, weights="int8")
    with pytest.raises(ValueError, match="weights='int4'"):
        TargetModel(tiny_target("llama", dtype=torch.float32).model, weights="int4")


def test_bf16_decode_kernel_unavailable_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setenv("DRAFTHEAD_CPU_KERNEL", "0")
    assert not extension.available()
    assert extension.unavailable_reason() == "DRAFTHEAD_CPU_KERNEL=0"
    with pytest.raises(RuntimeError, match="DRAFTHEAD_CPU_KERNEL=0"):
        cpu_linear.pack(torch.zeros(4, 8, dtype=torch.bfloat16))
    tm = TargetModel(tiny_target("llama", dtype=torch.bfloat16).model)
    assert not tm.decode_kernel  # the runtime uses oneDNN then


def test_draft_kv_cache_overflow_and_a_maskless_cache_write_are_named_errors(llama: Target) -> None:
    from drafthead.runtime.draft import DraftRunner

    d = random_drafter(llama)
    r = DraftRunner(d, 1, 4, torch.device("cpu"))
    H = llama.config.hidden_size
    with pytest.raises(ValueError, match=r"draft KV cache overflow: 0 prefix \+ 5 speculative entries > capacity 4"):
        r.extend(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, 3 * H), torch.tensor([5]))
    k = torch.zeros(1, d.config.num_key_value_heads, 1, d.config.head_dim)
    with pytest.raises(ValueError, match="needs the attention mask"):
        kv_cache((r.cache, torch.zeros(1, 1, dtype=torch.long)), k, k, None)


def test_causal_attention_mask_is_the_tree_mask_of_a_chain() -> None:
    """The causal mask (no tree mask) is built by one comparison; it must be the mask of a chain's tree."""
    from drafthead.runtime.model import attention_mask

    lens, S = torch.tensor([0, 5, 11]), 20
    for T in (1, 2, 9):
        chain = torch.ones(T, T, dtype=torch.bool).tril().expand(3, T, T)
        got = attention_mask(lens, T, S, None)
        assert got.shape == (3, 1, T, S) and torch.equal(got, attention_mask(lens, T, S, chain)), T
        assert int(got[1, 0, 0].sum()) == 6 and int(got[2, 0, T - 1].sum()) == 11 + T
        # a draft step's block: E earlier speculative entries, all seen, then the T new ones causally = the
        # causal mask of the new ones alone from slot lens + E
        for E in (1, 3):
            block = torch.cat([torch.ones(3, T, E, dtype=torch.bool), chain], dim=-1)  # [B, T, E+T]
            assert torch.equal(attention_mask(lens, T, S, block), attention_mask(lens + E, T, S, None)), (T, E)


def test_kv_cache_overflow_is_a_named_error(llama: Target) -> None:
    tm = TargetModel(llama.model)
    cache = tm.new_cache(1, 8)
    with pytest.raises(ValueError, match=r"KV cache overflow: 6 cached \+ 3 new tokens > capacity 8"):
        tm.forward(cache, torch.tensor([[5, 6, 7]]), torch.tensor([6]))


def test_attend_is_invariant_to_query_count_on_real_case() -> None:
    """Real SmolLM2 bf16 activations (layer 8) on which CPU SDPA's q_len-1 kernel rounds one ulp away from
    its block kernel; `attend` must give the lone query the same bits as the same query inside a block."""
    from pathlib import Path

    from safetensors.torch import load_file

    from drafthead.runtime.model import attend, attention_mask

    d = load_file(str(Path(__file__).parent / "assets" / "sdpa_q1_case.safetensors"))
    q, k, v, lens = d["q"], d["k"], d["v"], d["lens"]  # [1, 9, 8, 64], [1, 3, 112, 64] x2, [1]
    S = k.shape[2]
    block = attend(q, k, v, attention_mask(lens, 8, S, None), 0.125)
    for T in (1, 2, 5):
        assert torch.equal(attend(q[:, :, :T], k, v, attention_mask(lens, T, S, None), 0.125), block[:, :, :T]), T
    # the runtime's path for generated bf16 tokens: fixed-size query blocks, invariant by construction
    per_q = attend(q, k, v, attention_mask(lens, 8, S, None), 0.125, per_query=True)
    for T in (1, 2, 5, 8):
        got = attend(q[:, :, :T], k, v, attention_mask(lens, T, S, None), 0.125, per_query=True)
        assert torch.equal(got, per_q[:, :, :T]), T
    raw = torch.nn.functional.scaled_dot_product_attention(q[:, :, :1], k, v,
                                                           attn_mask=attention_mask(lens, 1, S, None),
                                                           scale=0.125, enable_gqa=True)
    if torch.equal(raw, block[:, :, :1]):  # AMD EPYC (AVX512-BF16)
        pytest.skip("SDPA's q_len-1 kernel matches its block kernel on this CPU: the stored case cannot fail here")


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_lossless_bf16(arch: str, path: str) -> None:
    """bf16 target: every setting reproduces the runtime's own bf16 AR output token for token, trees included
    (where the attention kernel runs: a node sums its ancestors' keys in key order, as its AR twin does), on
    each tile path the kernel probe can pick on this CPU."""
    with forced_path(path):
        _greedy_is_lossless_bf16(arch)


def _greedy_is_lossless_bf16(arch: str) -> None:
    target = tiny_target(arch, dtype=torch.bfloat16, seed=4, head_scale=4.0)
    gen = SpeculativeGenerator(target, random_drafter(target))
    oracle = SpeculativeGenerator(target, OracleDrafter(target, one_hot=True))
    prompts = random_prompts(4, 128, seed=17)
    want = [r.tokens for r in gen.generate(prompts, 24, SpecConfig(mode="ar"))]
    for spec in SETTINGS[:-1]:
        assert [r.tokens for r in gen.generate(prompts, 24, spec)] == want, spec
    got = oracle.generate(prompts, 24, SpecConfig(mode="chain", num_speculative_tokens=4))
    assert [r.tokens for r in got] == want
    assert sum(sum(r.accept_lens) for r in got) > 0  # the oracle's drafts were verified, not skipped
    # an fp32 draft on the bf16 target: bf16 features in, fp32 drafting; the target still decides
    gen32 = SpeculativeGenerator(target, random_drafter(target).float())
    for spec in (SpecConfig(mode="chain", num_speculative_tokens=3),
                 SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6),
                 SpecConfig(mode="chain", num_speculative_tokens=2, ngram=True, batch_size=2)):
        assert [r.tokens for r in gen32.generate(prompts, 24, spec)] == want, spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_weights_on_huge_pages_give_the_same_bits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's packed weights go on huge pages (`hugepages.HugePages`) where Linux offers them, and `paths()`
    says where they lie; prompts, decode steps and verify blocks give the same bits as on ordinary pages."""
    kind = cpu_linear.kind_for(dtype)
    if not extension.available(kind) or hugepages.huge_pages() is not None:
        pytest.skip(f"{kind} kernel: {extension.unavailable_reason(kind)}; huge pages: {hugepages.huge_pages()}")
    target = tiny_target("qwen3", dtype=dtype, seed=4, hidden_size=64, intermediate_size=128)
    prefix, new = torch.randint(3, 128, (2, 9)), torch.randint(3, 128, (2, 12))
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("DRAFTHEAD_HUGE_PAGES", on)
        tm = TargetModel(target.model, aux_layer_ids=[0, 1, 1])
        got[on] = forward_in_blocks(tm, prefix, new, [1, 3, 8], 32)
        if on == "1":  # (ordinary pages may be huge too where Linux's setting is `always`)
            assert hugepages.huge_page_bytes(tm.packed(target.model.lm_head).packed) > 0
        assert tm.paths().endswith("packed weights on 2 MB pages" if on == "1"
                                   else "packed weights on 4 KB pages: DRAFTHEAD_HUGE_PAGES=0")
    assert all(torch.equal(a, b) for a, b in zip(got["1"], got["0"]))


def test_prompts_take_onednn_on_amx_unless_the_kernel_runs_amx_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts go through the decode kernels except on AMX CPUs where the kernel is not on AMX tiles itself (oneDNN's
    tiles are faster there): either way generated tokens take the kernels and speculative output equals AR output;
    the prompt paths agree up to bf16 rounding."""
    if not (extension.available("bf16") and extension.available("fp32")):
        pytest.skip(f"CPU kernels unavailable: "
                    f"{extension.unavailable_reason('bf16') or extension.unavailable_reason('fp32')}")
    target = tiny_target("llama", dtype=torch.bfloat16, seed=4, head_scale=4.0)
    prompts = random_prompts(3, 128, seed=5)
    logits = {}
    cases = [("AVX512-BF16", "avx512", True), ("AMX", "avx512", False)]
    if "amx" in probe.cpu_paths():
        cases.append(("AMX", "amx", True))
    for cls, path, kernel in cases:
        monkeypatch.setattr(hardware, "cpu_class", lambda cls=cls: cls)
        with probe.use(probe.Setting(path, "t0", 32)):
            gen = SpeculativeGenerator(target, random_drafter(target))
            assert gen.model.prompt_kernel == kernel, (cls, path)
            want = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
            chain = gen.generate(prompts, 16, SpecConfig(mode="chain", num_speculative_tokens=3))
            assert [r.tokens for r in chain] == want
            cache = gen.model.new_cache(1, 32)
            logits[(cls, path)] = gen.model.forward(cache, torch.tensor([prompts[0]]), torch.zeros(1, dtype=torch.long),
                                                    prefill=True)[0].float()
    for key, got in logits.items():
        torch.testing.assert_close(got, logits[("AVX512-BF16", "avx512")], atol=0.1, rtol=0.05, msg=str(key))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_oracle_chain_accepts_everything(k: int, llama: Target) -> None:
    gen = SpeculativeGenerator(llama, OracleDrafter(llama))
    rounds = 4
    prompts = [p for p in random_prompts(6, 128, seed=k) if EOS not in reference_greedy(llama, p, 1 + rounds * (k + 1))]
    res = gen.generate(prompts[:3], 1 + rounds * (k + 1), SpecConfig(mode="chain", num_speculative_tokens=k))
    for r in res:
        assert r.accept_lens == [k] * rounds and r.num_drafted == [k] * rounds
        assert (len(r.tokens) - 1) / r.num_rounds == k + 1  # tau (prefill token aside) = k + 1


def test_oracle_tree_accepts_full_depth(llama: Target) -> None:
    gen = SpeculativeGenerator(llama, OracleDrafter(llama, one_hot=True))
    spec = SpecConfig(mode="tree", num_speculative_tokens=4, tree_nodes=8, topk=2)
    prompts = [p for p in random_prompts(6, 128, seed=7) if EOS not in reference_greedy(llama, p, 16)]
    for r in gen.generate(prompts[:2], 16, spec):
        assert r.accept_lens[:3] == [4, 4, 4]


def test_random_drafter_tau_near_one(llama: Target) -> None:
    gen = SpeculativeGenerator(llama, random_drafter(llama))
    res = gen.generate(random_prompts(4, 128, seed=11), 24, SpecConfig(mode="chain", num_speculative_tokens=3))
    tau = sum(len(r.tokens) - 1 for r in res) / sum(r.num_rounds for r in res)
    assert 1.0 <= tau < 1.3


def test_eos_inside_accepted_draft_stops(llama: Target) -> None:
    prompt = random_prompts(1, 128, seed=3)[0]
    free = reference_greedy(llama, prompt, 12)
    eos = free[3]  # make the 4th greedy token the EOS: an oracle chain of 4 accepts it mid-draft
    target = Target(llama.model, None, "tiny")
    old = llama.model.config.eos_token_id, llama.model.generation_config.eos_token_id
    llama.model.config.eos_token_id = llama.model.generation_config.eos_token_id = eos
    try:
        gen = SpeculativeGenerator(target, OracleDrafter(llama))
        (r,) = gen.generate([prompt], 12, SpecConfig(mode="chain", num_speculative_tokens=4))
    finally:
        llama.model.config.eos_token_id, llama.model.generation_config.eos_token_id = old
    assert r.tokens == free[: free.index(eos) + 1] and r.stopped_eos


def test_stream_gets_every_token_in_order(llama: Target) -> None:
    gen = SpeculativeGenerator(llama, random_drafter(llama))
    seen: dict[int, list[int]] = {0: [], 1: []}
    res = gen.generate(random_prompts(2, 128, seed=4), 10, SpecConfig(mode="tree", batch_size=2, ngram=True),
                       stream=lambda i, toks: seen[i].extend(toks))
    assert [seen[0], seen[1]] == [r.tokens for r in res]


# ---- KV rollback --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,kind", [("chain", "random"), ("tree", "random"), ("tree", "oracle")])
def test_kv_after_rounds_equals_fresh_prefill(mode: str, kind: str, qwen3: Target) -> None:
    drafter = random_drafter(qwen3) if kind == "random" else OracleDrafter(qwen3, one_hot=True)
    gen = SpeculativeGenerator(qwen3, drafter)
    spec = SpecConfig(mode=mode, num_speculative_tokens=6 if mode == "chain" else 3, tree_nodes=6, topk=2, batch_size=2)
    prompts = [p for p in random_prompts(8, 128, seed=21) if EOS not in reference_greedy(qwen3, p, 40)][:2]
    reqs = [_Request(i, p, 40) for i, p in enumerate(prompts)]
    s = _Session(gen, reqs, spec, torch.Generator().manual_seed(0), None)
    s.prefill()
    for _ in range(3):
        s.step()
    if kind == "oracle":  # the accepted path skips sibling nodes, so the target KV had to be compacted
        assert all(r.accept_lens == [3, 3, 3] for r in s.reqs)
    tm = gen.model
    with torch.inference_mode():
        for b, r in enumerate(s.reqs):
            seq = r.history[:-1]  # the root (last token) is not cached yet
            L = len(seq)
            assert int(s.lens[b]) == L
            fresh = tm.new_cache(1, L + 1)
            _, aux = tm.forward(fresh, torch.tensor([seq]), torch.zeros(1, dtype=torch.long), capture=True)
            torch.testing.assert_close(s.cache[b, :, :L], fresh[0, :, :L], atol=1e-10, rtol=0)
            # draft prefix: entry t = (x_{t+1}, fuse(f_t)) recomputed from scratch
            nxt = torch.tensor([seq[1:] + [r.history[-1]]])
            _, _, cache = drafter.decode(nxt, drafter.fuse(aux), torch.arange(L)[None])
            assert int(s.draft.lens[b]) == L
            torch.testing.assert_close(s.draft.cache[b, :, :L], cache[0], atol=1e-10, rtol=0)


# ---- batching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [SpecConfig(mode="chain", num_speculative_tokens=3, adaptive=True),
                                  SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=8, topk=3, ngram=True),
                                  SpecConfig(mode="ngram", num_speculative_tokens=5)])
def test_batch_equals_per_request(spec: SpecConfig, llama: Target) -> None:
    drafter = OracleDrafter(llama, one_hot=True) if spec.mode == "tree" else random_drafter(llama)
    gen = SpeculativeGenerator(llama, drafter)
    prompts = random_prompts(5, 128, seed=8)
    single = gen.generate(prompts, 20, spec)
    batched = gen.generate(prompts, 20, replace(spec, batch_size=3))
    assert [r.tokens for r in batched] == [r.tokens for r in single]
    assert [r.accept_lens for r in batched] == [r.accept_lens for r in single]


# ---- sampling is lossless -----------------------------------------------------------------------
V_SMALL = 8


def exact_joint(target: Target, prompt: list[int], n: int, temperature: float, top_p: float) -> torch.Tensor:
    """P(x_1..x_n | prompt) under tempered / top-p sampling, flattened over V^n."""
    seqs = torch.tensor(list(itertools.product(range(V_SMALL), repeat=n)))  # [V^n, n]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.model(ids).logits[:, len(prompt) - 1: -1]  # [V^n, n, V]
    p = probs(logits, temperature, top_p)
    return p.gather(2, seqs[:, :, None])[:, :, 0].double().prod(1)


def empirical_joint(results: list[GenerationResult], n: int) -> torch.Tensor:
    counts = torch.zeros(V_SMALL ** n, dtype=torch.float64)
    for r in results:
        idx = 0
        for t in r.tokens[:n]:
            idx = idx * V_SMALL + t
        counts[idx] += 1
    return counts / counts.sum()


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target("llama", vocab=V_SMALL, seed=2, dtype=torch.float32, head_scale=20.0)
    target.model.config.eos_token_id = target.model.generation_config.eos_token_id = None  # no early stop
    drafter = random_drafter(target, seed=9, draft_vocab=6)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(5.0)  # a confident draft that often disagrees with the target
    prompt = [3, 5, 1, 6]
    return target, drafter, prompt


def sample_tv(setup, spec: SpecConfig, n_samples: int = 8000, n_tokens: int = 3) -> float:
    """Total variation between the empirical joint of the first n_tokens and the exact target joint.
    With 8000 samples an exact sampler lands at ~0.035 here; the biased samplers below at ~0.2 and ~0.8."""
    target, drafter, prompt = setup
    gen = SpeculativeGenerator(target, drafter)
    res = gen.generate([prompt] * n_samples, n_tokens, replace(spec, batch_size=1000))
    exact = exact_joint(target, prompt, n_tokens, spec.temperature, spec.top_p)
    return 0.5 * float((empirical_joint(res, n_tokens) - exact).abs().sum())


SAMPLING = [
    SpecConfig(mode="ar", temperature=1.0),
    SpecConfig(mode="chain", num_speculative_tokens=2, temperature=1.0),
    SpecConfig(mode="chain", num_speculative_tokens=3, temperature=0.7, top_p=0.8, adaptive=True),
    SpecConfig(mode="tree", num_speculative_tokens=2, tree_nodes=4, topk=2, temperature=1.0),
    SpecConfig(mode="ngram", num_speculative_tokens=2, temperature=1.0),
]


@pytest.mark.parametrize("spec", SAMPLING, ids=lambda s: f"{s.mode}-T{s.temperature}-p{s.top_p}")
def test_speculative_sampling_matches_target(spec: SpecConfig, sampling_setup) -> None:
    assert sample_tv(sampling_setup, spec) < 0.07


@pytest.mark.parametrize("bug", ["accept_all", "no_residual"])
def test_biased_sampler_is_detected(bug: str, sampling_setup, monkeypatch) -> None:
    """The TV check has teeth: accepting every draft (= sampling the draft), or resampling from p instead of
    the residual max(p - q, 0) after a rejection (a classic bug), both fail it."""
    honest = ops.rejection_sample_chain

    def biased(draft_tokens, draft_probs, target_probs, uniforms, bonus_uniforms):
        B, K = draft_tokens.shape
        rows = torch.arange(B)
        if bug == "accept_all":
            accept_len = torch.full((B,), K)
        else:
            accept_len, _ = honest(draft_tokens, draft_probs, target_probs, uniforms, bonus_uniforms)
        p = target_probs[rows, accept_len]  # [B, V]
        nxt = honest(draft_tokens[:, :0], None, p[:, None], uniforms[:, :0], bonus_uniforms)[1]  # a draw from p
        return accept_len, nxt

    monkeypatch.setattr(ops, "rejection_sample_chain", biased)
    assert sample_tv(sampling_setup, SpecConfig(mode="chain", num_speculative_tokens=2, temperature=1.0)) > 0.15


# ---- adaptive depth -----------------------------------------------------------------------------
def test_adaptive_k_grows_with_oracle_and_shrinks_with_random(llama: Target) -> None:
    prompts = [p for p in random_prompts(8, 128, seed=5) if EOS not in reference_greedy(llama, p, 80)][:1]
    spec = SpecConfig(mode="chain", num_speculative_tokens=5, adaptive=True)
    (up,) = SpeculativeGenerator(llama, OracleDrafter(llama)).generate(prompts, 80, spec)
    assert up.num_drafted[0] == 3 and up.num_drafted[-1] == 5 and up.num_drafted == sorted(up.num_drafted)
    (down,) = SpeculativeGenerator(llama, random_drafter(llama)).generate(prompts, 80, spec)
    assert down.num_drafted[0] == 3 and down.num_drafted[-1] == 1
    tree = SpecConfig(mode="tree", num_speculative_tokens=5, tree_nodes=12, topk=2, adaptive=True)
    (up,) = SpeculativeGenerator(llama, OracleDrafter(llama, one_hot=True)).generate(prompts, 80, tree)
    assert up.num_drafted[0] == 3 and up.num_drafted[-1] == 5
    (down,) = SpeculativeGenerator(llama, random_drafter(llama)).generate(prompts, 80, tree)
    assert down.num_drafted[-1] == 1


# ---- n-gram lookup ------------------------------------------------------------------------------
def test_ngram_lookup() -> None:
    h = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert ngram_lookup(h, 3, 4) == [4, 5, 9, 1]  # continue after the earlier "1 2 3"
    assert ngram_lookup(h, 3, 2) == [4, 5]
    assert ngram_lookup([7, 8, 9, 8], 3, 3) == [9, 8]  # falls back to the 1-gram "8"
    assert ngram_lookup([1, 2, 3], 2, 3) == []
    assert ngram_lookup([5, 5, 5, 5], 2, 3) == [5]  # most recent match: only one token follows it


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_errors(llama: Target) -> None:
    gen = SpeculativeGenerator(llama, random_drafter(llama))
    spec = SpecConfig()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([[5, 6], []], 4, spec)
    with pytest.raises(ValueError, match="longer than the target context"):
        gen.generate([[5] * 300], 4, spec)
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        gen.generate([[5, 6]], 0, spec)
    with pytest.raises(ValueError, match="outside the target vocab"):
        gen.generate([[5, 600]], 4, spec)
    with pytest.raises(ValueError, match="unknown spec mode"):
        gen.generate([[5, 6]], 4, SpecConfig(mode="beam"))
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeGenerator(llama).generate([[5, 6]], 4, SpecConfig(mode="tree"))
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([[5, 6]], 4, SpecConfig(top_p=0.0))


def test_drafter_target_mismatch_errors(llama: Target) -> None:
    other = tiny_target("llama", hidden_size=48)
    with pytest.raises(ValueError, match="draft/target mismatch: hidden size"):
        SpeculativeGenerator(llama, random_drafter(other))
    bigger = tiny_target("llama", vocab=200)
    with pytest.raises(ValueError, match="draft/target mismatch: vocab"):
        SpeculativeGenerator(llama, random_drafter(bigger))
    d = random_drafter(llama)
    d.config.aux_layer_ids = [0, 1, 7]
    with pytest.raises(ValueError, match=r"aux layer ids \[0, 1, 7\] out of range"):
        SpeculativeGenerator(llama, d)


def test_stacked_ngram_skips_drafting_when_its_chain_wins_everywhere(llama: Target, monkeypatch) -> None:
    """chain + n-gram: a round where every request's n-gram chain is longer than the draft chain runs no
    draft steps (their proposal would be discarded); without n-gram matches every round drafts. The
    output is the AR output either way."""
    from drafthead.runtime import draft as runtime_draft
    from drafthead.runtime import generate as runtime_generate

    calls = []
    real = runtime_draft.DraftRunner.chain
    monkeypatch.setattr(runtime_draft.DraftRunner, "chain",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    gen = SpeculativeGenerator(llama, random_drafter(llama))
    prompts = random_prompts(3, 128, seed=5)
    want = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
    spec = SpecConfig(mode="chain", num_speculative_tokens=2, ngram=True, batch_size=2)
    for lookup, drafts in ((lambda history, n, cap: [7] * cap, False),  # always a 2k-token match: it wins
                           (lambda history, n, cap: [7] * 2, True),  # as long as the draft chain: the draft wins
                           (lambda history, n, cap: [], True)):  # no match
        monkeypatch.setattr(runtime_generate, "ngram_lookup", lookup)
        calls.clear()
        got = gen.generate(prompts, 16, spec)
        assert [r.tokens for r in got] == want
        rounds = max(got[0].num_rounds, got[1].num_rounds) + got[2].num_rounds  # batches [0, 1] and [2]
        assert len(calls) == (rounds if drafts else 0)


# ---- real target --------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_speculative_matches_ar() -> None:
    from drafthead.target import load_target

    target = load_target("smollm2-135m-instruct", dtype="float32")  # parity with HF generate: fp32 on every CPU
    tok = target.tokenizer
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n# repeat the function above:\n"
    prompt = tok(text)["input_ids"]
    gen = SpeculativeGenerator(target)
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    (ar,) = gen.generate([prompt], 24, SpecConfig(mode="ar"))
    (ng,) = gen.generate([prompt], 24, SpecConfig(mode="ngram", num_speculative_tokens=4))
    assert ar.tokens == hf.tolist()[: len(ar.tokens)]
    assert ng.tokens == ar.tokens
    assert sum(ng.accept_lens) > 0  # the prompt is full of copyable spans
    # an untrained EAGLE3 head at real sizes (aux capture of 3 x 576, 32k draft vocab): still lossless
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=32000)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight)
    d2t, t2d = build_vocab_mapping(torch.arange(cfg.vocab_size).flip(0), 32000)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    spec = SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=8, topk=2, ngram=True)
    (tree,) = SpeculativeGenerator(target, drafter).generate([prompt], 24, spec)
    assert tree.tokens == ar.tokens


@pytest.mark.slow
@pytest.mark.skipif(not hardware.native_bf16(), reason="bf16 is emulated on this CPU class (dtype auto runs fp32 "
                    "here); bf16 exactness is covered on tiny models, this real-size case on native-bf16 CPUs")
def test_smollm2_bf16_batched_verify_block_is_bitwise() -> None:
    """The real target in bf16: 4 requests verifying 10 nodes each (40 rows per projection) give the same
    logits and aux features, bit for bit, as the same tokens decoded one at a time (before row chunking no
    row matched: max logit difference 0.72)."""
    from drafthead.target import load_target

    target = load_target("smollm2-135m-instruct", dtype="bfloat16")
    tm = TargetModel(target.model, [2, 15, 27])
    g = torch.Generator().manual_seed(0)
    prefix, new = torch.randint(0, 49152, (4, 100), generator=g), torch.randint(0, 49152, (4, 10), generator=g)
    logits, aux = forward_in_blocks(tm, prefix, new, [1] * 10, 200)
    block_logits, block_aux = forward_in_blocks(tm, prefix, new, [10], 200)
    assert torch.equal(block_logits, logits) and torch.equal(block_aux, aux)


def tree_vs_paths(tm: TargetModel, prefix: torch.Tensor, nodes: torch.Tensor, parents: list[int]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of a tree's nodes [T, V] from one tree-verify forward on `prefix` [1, P], and of each node decoded
    one token at a time down its own path (root .. node at contiguous slots, as AR decoding would place them)."""
    T, P = len(parents), prefix.shape[1]
    path = [[i] for i in range(T)]
    for i in range(T):
        while parents[path[i][0]] >= 0:
            path[i].insert(0, parents[path[i][0]])
    anc = torch.zeros(1, T, T, dtype=torch.bool)  # [1, T, T] ancestor-or-self
    for i in range(T):
        anc[0, i, path[i]] = True
    depth = torch.tensor([[len(p) - 1 for p in path]])  # [1, T]
    cache, lens = tm.new_cache(1, P + T + 4), torch.zeros(1, dtype=torch.long)
    tm.forward(cache, prefix, lens, prefill=True)
    tree, _ = tm.forward(cache.clone(), nodes, lens + P, tree_mask=anc, depth=depth)  # [1, T, V]
    alone = []
    for i in range(T):
        c = cache.clone()
        for j, node in enumerate(path[i]):
            out, _ = tm.forward(c, nodes[:, node: node + 1], lens + P + j)  # [1, 1, V]
        alone.append(out[0, -1])
    return tree[0], alone


@pytest.mark.slow
@pytest.mark.skipif(not hardware.native_bf16(), reason="bf16 is emulated on this CPU class (dtype auto runs fp32 "
                    "here); bf16 exactness is covered on tiny models, this real-size case on native-bf16 CPUs")
def test_smollm2_bf16_tree_verify_is_bitwise() -> None:
    """The real target in bf16: each node of a verified tree (ancestors at scattered slots among masked siblings)
    gets the logits its path gets decoded token by token, bit for bit. The attention kernel sums a query's
    allowed keys in key order, so a tree node and its AR twin see the same keys in the same order."""
    from drafthead.target import load_target

    tm = TargetModel(load_target("smollm2-135m-instruct", dtype="bfloat16").model)
    assert tm.decode_kernel and tm.decode_ops
    g = torch.Generator().manual_seed(0)
    prefix, nodes = torch.randint(0, 49152, (1, 100), generator=g), torch.randint(0, 49152, (1, 7), generator=g)
    tree, alone = tree_vs_paths(tm, prefix, nodes, [-1, 0, 0, 1, 1, 2, 2])
    for i, logits in enumerate(alone):
        assert torch.equal(tree[i], logits), i
