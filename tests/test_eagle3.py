"""EAGLE3 drafter math: TTT mask shape and causality, training/inference parity, vocab mapping."""
import pytest
import torch
from transformers import LlamaConfig

from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.layers import shift as _shift
from drafthead.vocab import build_vocab_mapping, draft_ids, target_to_draft

V, H = 96, 32


def tiny_drafter(ttt: int = 3, seed: int = 0, n_draft: int = 64, **options) -> Eagle3Drafter:
    torch.manual_seed(seed)
    tcfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256)
    c = Eagle3Config.from_target(tcfg, draft_vocab_size=n_draft, aux_layer_ids=[1, 2, 3], num_draft_tokens=ttt,
                                 **options)
    m = Eagle3Drafter(c)
    if m.fc_norm is not None:  # norms away from 1, so a norm applied to the wrong part shows
        with torch.no_grad():
            for norm in m.fc_norm:
                norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    torch.nn.init.normal_(m.embed_tokens.weight, std=0.5)
    d2t, t2d = build_vocab_mapping(torch.arange(V).flip(0).clone(), n_draft)
    m.d2t.copy_(d2t)
    m.t2d.copy_(t2d)
    return m.eval()


def test_d2t_t2d_round_trip():
    counts = torch.randint(0, 100, (500,))
    d2t, t2d = build_vocab_mapping(counts, 128)
    ids = draft_ids(d2t)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert t2d.sum() == 128 and t2d[ids].all()
    assert torch.equal(target_to_draft(t2d)[ids], torch.arange(128))
    assert (ids.diff() > 0).all()  # sorted by target id
    top = torch.sort(-counts, stable=True).indices[:128]
    assert set(ids.tolist()) == set(top.tolist())  # the most frequent tokens
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(counts, 501)


def test_default_aux_layer_ids_match_serving_engines():
    # SGLang / vLLM / llama.cpp default: inputs of layers 2, N//2, N-3
    assert Eagle3Config.default_aux_layer_ids(30) == [2, 15, 27]
    assert Eagle3Config.default_aux_layer_ids(36) == [2, 18, 33]


def _batch(m: Eagle3Drafter, B: int = 2, T: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * H, generator=g)
    teacher = torch.randn(B, T, m.config.draft_vocab_size, generator=g)
    tgt = draft_ids(m.d2t)[teacher.argmax(-1)]
    mask = torch.ones(B, T, dtype=torch.long)
    return ids, aux, teacher.softmax(-1), tgt, mask


def test_ttt_matches_inference_decode():
    """Step i of the unrolled training-time test == chain step i of the KV-cached inference path."""
    m = tiny_drafter(ttt=3)
    ids, aux, teacher, tgt, mask = _batch(m, B=1, T=10)
    T = ids.shape[1]
    # training path: capture the per-step hidden states through a forward hook on the final norm
    seen = []
    h = m.norm.register_forward_hook(lambda mod, a, out: seen.append(a[0].detach()))
    m(ids, aux, teacher, tgt, mask)
    h.remove()
    # inference path, for one position t: prefix entries s <= t, then chain steps
    t = 4
    hidden = m.fuse(aux[:, : t + 1])
    pos = torch.arange(t + 1)[None]
    _, out, kv = m.decode(ids[:, 1: t + 2], hidden, pos)
    h_prev = out[:, -1:]
    # training step-0 rows are gathered over positions with mask[t+2]; position t is row t here (all ones)
    step0 = seen[0]
    assert torch.allclose(step0[t], m.norm.weight * 0 + step0[t])  # row exists
    ref0 = m.norm(out[0, -1])
    assert torch.allclose(m.norm(step0[t]), ref0, atol=1e-5)
    for i in range(1, 3):
        _, out_i, kv = m.decode(ids[:, t + 1 + i: t + 2 + i], h_prev, torch.tensor([[t + i]]), kv=kv)
        n_rows = T - 2 - i  # valid positions at step i
        assert seen[i].shape[0] == n_rows
        assert torch.allclose(seen[i][t], out_i[0, 0], atol=1e-5), f"step {i}"
        h_prev = out_i


@pytest.mark.parametrize("fc_norm,norm_output", [(False, True), (True, False), (True, True)])
def test_eagle31_ttt_matches_inference_decode(fc_norm, norm_output):
    """With the EAGLE 3.1 norms, step i of the TTT == chain step i of the KV-cached path, read at the head input
    (lm_head's rows) and at the hidden state the next step reads."""
    m = tiny_drafter(ttt=3, fc_norm=fc_norm, norm_output=norm_output)
    ids, aux, teacher, tgt, mask = _batch(m, B=1, T=10)
    seen = []
    h = m.lm_head.register_forward_hook(lambda mod, a, out: seen.append(a[0].detach()))
    m(ids, aux, teacher, tgt, mask)
    h.remove()
    t = 4
    _, out, kv = m.decode(ids[:, 1: t + 2], m.fuse(aux[:, : t + 1]), torch.arange(t + 1)[None])
    torch.testing.assert_close(seen[0][t], m.head_input(out[0, -1]), rtol=0, atol=1e-5)
    h_prev = out[:, -1:]
    for i in range(1, 3):
        _, h_prev, kv = m.decode(ids[:, t + 1 + i: t + 2 + i], h_prev, torch.tensor([[t + i]]), kv=kv)
        torch.testing.assert_close(seen[i][t], m.head_input(h_prev[0, 0]), rtol=0, atol=1e-5, msg=f"step {i}")
    if norm_output:  # what the next step reads is normed: RMS of hidden / weight is 1 in every row
        rms = (h_prev / m.norm.weight).pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


def test_eagle31_norms_change_what_they_claim():
    """fc_norm makes fc blind to each captured layer's scale; norm_output leaves step 0's logits alone and
    changes what later steps read."""
    ids, aux, _, _, _ = _batch(tiny_drafter(), B=1, T=8)
    pos = torch.arange(8)[None]
    scaled = aux.clone()
    scaled[..., H: 2 * H] *= 50.0  # one captured layer 50x louder
    with torch.no_grad():
        on = tiny_drafter(fc_norm=True)
        torch.testing.assert_close(on.fuse(scaled), on.fuse(aux), rtol=1e-4, atol=1e-4)
        off = tiny_drafter()
        assert not torch.allclose(off.fuse(scaled), off.fuse(aux), atol=1e-2)
        plain, post = tiny_drafter(), tiny_drafter(norm_output=True)  # the same weights (same seed)
        runs = []
        for m in (plain, post):
            logits0, out, kv = m.decode(ids, m.fuse(aux), pos)
            logits1, _, _ = m.decode(ids[:, -1:], out[:, -1:], torch.tensor([[8]]), kv=kv)
            runs.append((logits0, logits1))
        torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=1e-6)
        assert not torch.allclose(runs[0][1], runs[1][1], atol=1e-3)


def test_ttt_causality_future_tokens_do_not_leak():
    m = tiny_drafter(ttt=3)
    ids, aux, teacher, tgt, mask = _batch(m, B=1, T=14)
    seen_a, seen_b = [], []
    h = m.norm.register_forward_hook(lambda mod, a, out: seen_a.append(a[0].detach()))
    m(ids, aux, teacher, tgt, mask)
    h.remove()
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[:, 9:] = (ids2[:, 9:] + 7) % V  # change the future from position 9 on
    aux2[:, 9:] += 1.0
    h = m.norm.register_forward_hook(lambda mod, a, out: seen_b.append(a[0].detach()))
    m(ids2, aux2, teacher, tgt, mask)
    h.remove()
    for i in range(3):
        # step i at position t reads tokens up to t+1+i and features up to t
        safe = 9 - 2 - i
        assert torch.allclose(seen_a[i][: safe + 1], seen_b[i][: safe + 1], atol=1e-6), f"step {i} leaks"
        assert not torch.allclose(seen_a[i][safe + 2:], seen_b[i][safe + 2:])


def test_loss_mask_and_accuracy():
    m = tiny_drafter(ttt=2)
    ids, aux, teacher, tgt, mask = _batch(m, B=2, T=10)
    mask[:, :5] = 0
    out = m(ids, aux, teacher, tgt, mask)
    # step i counts positions t with mask[t+2+i] == 1: t in 3..7 (i=0), 2..6 (i=1): 5 per row each
    assert out["count"].tolist() == [2 * 5, 2 * 5]
    mask2 = mask.clone()
    mask2[:, -1] = 0  # the last token unsupervised: step 1 loses position 6, step 0 position 7
    assert m(ids, aux, teacher, tgt, mask2)["count"].tolist() == [2 * 4, 2 * 4]
    assert 0 <= out["correct"][0] <= out["count"][0]
    out["loss"].backward()
    assert m.fc.weight.grad is not None and m.embed_tokens.weight.grad is None
    assert torch.isfinite(out["loss"])


def test_shift():
    x = torch.arange(6).view(1, 6)
    assert _shift(x, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    assert _shift(x, 7).tolist() == [[0] * 6]


def test_init_from_target_copies_embedding_and_head_rows():
    m = tiny_drafter()
    emb = torch.randn(V, H)
    head = torch.randn(V, H)
    norm = torch.rand(H)
    m.init_from_target(emb, head, norm)
    assert torch.equal(m.embed_tokens.weight, emb)
    assert torch.equal(m.lm_head.weight, head[draft_ids(m.d2t)])  # draft row i = target row d2t-mapped
    assert torch.equal(m.norm.weight, norm)
    before = m.lm_head.weight.clone()
    m.init_from_target(emb)  # head untouched without lm_head
    assert torch.equal(m.lm_head.weight, before)


def test_feature_loss_adds_the_regression_of_the_next_targets_hidden():
    """feature_loss_weight > 0: step i also pulls norm(draft hidden at t) towards the target's hidden at
    t+1+i (smooth L1, mean over rows and channels). Step 0's term is checked against the inference path's
    hidden state; omitting the target is an error."""
    import torch.nn.functional as F

    m = tiny_drafter(ttt=1)
    ids, aux, teacher, tgt, mask = _batch(m, B=2, T=10)
    last = torch.randn(2, 10, H)
    base = m(ids, aux, teacher, tgt, mask)["loss"]
    m.config.feature_loss_weight = 0.5
    with pytest.raises(ValueError, match="needs last_hidden"):
        m(ids, aux, teacher, tgt, mask)
    out = m(ids, aux, teacher, tgt, mask, last_hidden=last)
    with torch.no_grad():  # step 0 = one causal decode pass over (x_{t+1}, f_t)
        pos = torch.arange(10).expand(2, 10)
        _, hidden, _ = m.decode(_shift(ids, 1), m.fuse(aux), pos)
    b, t = _shift(mask, 2).bool().nonzero(as_tuple=True)
    want = 0.5 * F.smooth_l1_loss(m.norm(hidden[b, t]), last[b, t + 1], reduction="sum") / (b.numel() * H)
    assert torch.allclose(out["loss"] - base, want, atol=1e-5)
    m.zero_grad()
    out["loss"].backward()
    assert m.fc.weight.grad is not None and m.fc.weight.grad.abs().sum() > 0


def test_hard_label_weight_mixes_a_one_hot_on_the_target_argmax():
    """hard_label_weight = w trains towards (1 - w) p + w onehot(argmax): the loss is (1 - w) soft CE +
    w hard CE, checked at w = 1 against the cross-entropy of the inference path's logits; rows whose
    argmax is outside the draft vocabulary stay out of both."""
    import torch.nn.functional as F

    m = tiny_drafter(ttt=1)
    ids, aux, teacher, tgt, mask = _batch(m, B=2, T=10)
    tgt[0, 4] = int((~m.t2d).nonzero()[0])  # one target outside the draft vocab
    soft = m(ids, aux, teacher, tgt, mask)["loss"]
    m.config.hard_label_weight = 1.0
    hard = m(ids, aux, teacher, tgt, mask)["loss"]
    with torch.no_grad():
        pos = torch.arange(10).expand(2, 10)
        logits, _, _ = m.decode(_shift(ids, 1), m.fuse(aux), pos)  # [B, T, N]
    b, t = _shift(mask, 2).bool().nonzero(as_tuple=True)
    want_t = tgt[b, t + 1]
    keep = m.t2d[want_t]
    assert (~keep).sum() == 1
    want = F.cross_entropy(logits[b, t][keep], target_to_draft(m.t2d)[want_t[keep]], reduction="sum") / b.numel()
    torch.testing.assert_close(hard, want, rtol=1e-5, atol=1e-5)
    m.config.hard_label_weight = 0.25
    torch.testing.assert_close(m(ids, aux, teacher, tgt, mask)["loss"], 0.75 * soft + 0.25 * hard, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_before_residual,norm_output", [(False, False), (True, False), (False, True)])
def test_one_call_draft_step_gives_the_op_by_op_bits(dtype, norm_before_residual, norm_output, monkeypatch):
    """A packed CPU draft step (the runtime's copy, `with_packed_linears`) runs its layer in one extension call
    (`layers.one_call_layer`, DecodeLayer.forward_input). Logits, output hidden and the KV cache written must be
    the op-by-op path's bits, for a lone token and a causal block, two requests at their own slots."""
    import drafthead.eagle3 as eagle3
    from drafthead.kernels import extension, packing
    from drafthead.layers import one_call_layer

    kinds = ("fp32",) if dtype == torch.float32 else ("fp32", "bf16")
    if not all(extension.available(k) for k in kinds):
        pytest.skip(f"CPU kernel unavailable: {[extension.unavailable_reason(k) for k in kinds]}")
    m = tiny_drafter(norm_output=norm_output)
    m.config.norm_before_residual = norm_before_residual
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for norm in (m.midlayer.input_layernorm, m.midlayer.hidden_norm, m.midlayer.post_attention_layernorm, m.norm):
            norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=g))
    packed = packing.with_packed_linears(m.to(dtype))
    c = m.config
    layer, attn = packed.midlayer, packed.midlayer.self_attn
    assert one_call_layer(packed, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          layer.post_attention_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                          layer.mlp) is not None
    B, S, lens = 2, 16, torch.tensor([5, 9])
    cache = torch.randn(B, 2 * c.num_key_value_heads, S, c.head_dim, generator=g).to(dtype)
    for T in (1, 3):
        ids = torch.randint(0, V, (B, T), generator=g)
        hidden = torch.randn(B, T, H, generator=g).to(dtype)
        slots = lens[:, None] + torch.arange(T)  # [B, T] = rope positions
        rel = torch.arange(S)[None, None] - slots[:, :, None]  # [B, T, S]
        mask = ((torch.arange(S)[None, None] < lens[:, None, None]) | ((rel <= 0) & (rel > -T)))[:, None]
        at = torch.tensor([T - 1, 0])
        runs = []
        for one_call in (True, False):
            if not one_call:
                monkeypatch.setattr(eagle3, "one_call_layer", lambda *a, **k: None)
            kv = cache.clone()
            with torch.inference_mode():
                logits, out, _ = packed.decode(ids, hidden, slots, (kv, slots), mask)
                head, _, _ = packed.decode(ids, hidden, slots, (kv.clone(), slots), mask, logits_at=at)
            runs.append((logits, out, kv, head))
        monkeypatch.undo()
        for got, want in zip(*runs):
            assert torch.equal(got, want), f"T={T}"
        logits, _, kv, head = runs[0]
        assert torch.equal(head[:, 0], logits[torch.arange(B), at])
        assert not torch.equal(kv, cache) and torch.equal(kv[0, :, :5], cache[0, :, :5])  # only the slots changed
