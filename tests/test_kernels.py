"""Verify kernels: Triton (interpreter on CPU) vs the PyTorch reference, and the reference's own semantics.

The Triton decorators read TRITON_INTERPRET when `drafthead.kernels.triton_kernels` is imported, so it is set
before that import (and the module is reloaded if something imported it earlier without the interpreter).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _set_interpret(value: str | None) -> str | None:
    previous = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return previous


_previous = _set_interpret("1")
import drafthead.kernels.triton_kernels as tk  # noqa: E402
import triton  # noqa: E402

if not tk.INTERPRETED:
    tk = importlib.reload(tk)
_set_interpret(_previous)  # do not leak into the collection of other test files


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """The interpreter also reads TRITON_INTERPRET at launch time (lazy imports), so keep it on while we run."""
    previous = _set_interpret("1")
    yield
    _set_interpret(previous)


@pytest.fixture(autouse=True)
def _interpreter_can_run(request):
    if "triton" in request.node.name and not tk.INTERPRETER_LOOPS_OVER_LOADS and tk.INTERPRETED:
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot loop over a loaded scalar (compiled kernels: "
                    f"scripts/gpu_check.py)")

from drafthead.kernels import reference as ref  # noqa: E402
from drafthead.kernels import verify  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ builders
def random_tree(g: torch.Generator, B: int, N: int, V: int, style: str = "random", pad: bool = True):
    """(tokens, parents, num_nodes); padding slots hold garbage that every implementation must ignore."""
    parents = torch.full((B, N), -1, dtype=torch.long)
    for i in range(1, N):
        if style == "chain":
            parents[:, i] = i - 1
        elif style == "star":
            parents[:, i] = 0
        else:
            parents[:, i] = torch.randint(0, i, (B,), generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    num_nodes = torch.randint(1, N + 1, (B,), generator=g) if pad else torch.full((B,), N, dtype=torch.long)
    slot = torch.arange(N)
    padding = slot >= num_nodes[:, None]
    parents = torch.where(padding, torch.randint(-3, N + 3, (B, N), generator=g), parents)
    tokens = torch.where(padding, torch.randint(-5, V + 5, (B, N), generator=g), tokens)
    return tokens, parents, num_nodes


def children(parents: torch.Tensor, num_nodes: torch.Tensor, b: int, u: int) -> list[int]:
    return [c for c in range(1, int(num_nodes[b])) if int(parents[b, c]) == u]


def argmax_that_often_matches(g, tokens, parents, num_nodes, V):
    """target_argmax where each node's choice equals one of its children's tokens 70% of the time."""
    B, N = tokens.shape
    am = torch.randint(0, V, (B, N), generator=g)
    for b in range(B):
        for u in range(int(num_nodes[b])):
            kids = children(parents, num_nodes, b, u)
            if kids and torch.rand((), generator=g) < 0.7:
                am[b, u] = tokens[b, kids[int(torch.randint(len(kids), (), generator=g))]]
    return am


def probs_that_often_accept(g, tokens, parents, num_nodes, V, shift=2.0):
    """target_probs [B, N, V] with extra mass on each node's child tokens, so both accepts and rejects happen."""
    B, N = tokens.shape
    logits = torch.randn(B, N, V, generator=g)
    for b in range(B):
        for c in range(1, int(num_nodes[b])):
            logits[b, parents[b, c], tokens[b, c]] += shift
    return torch.softmax(logits, dim=-1)


def assert_same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"triton {a} != reference {b}"


SHAPES = [  # (seed, B, N, V, tree style)
    (0, 1, 1, 16, "random"), (1, 1, 6, 16, "chain"), (2, 3, 9, 37, "random"), (3, 8, 12, 64, "random"),
    (4, 5, 7, 16, "star"), (5, 2, 16, 40, "random"), (6, 8, 5, 33, "chain"), (7, 4, 11, 64, "random"),
]


# ------------------------------------------------------------------------------------------------ reference semantics
def hand_tree():
    """root(0) -> 1:'a'=10, 2:'b'=11 ; 1 -> 3:'c'=12, 4:'d'=13 ; 2 -> 5:'c'=12 ; 4 -> 6:'e'=14 ; slot 7 padding."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4, 99]])
    tokens = torch.tensor([[7, 10, 11, 12, 13, 12, 14, -1]])
    return tokens, parents, torch.tensor([7])


def test_tree_mask_reference_on_hand_tree():
    _, parents, num_nodes = hand_tree()
    mask, depth = ref.build_tree_mask(parents, num_nodes)
    assert depth.tolist() == [[0, 1, 1, 2, 2, 2, 3, 0]]
    ancestors = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 4, 6}, {7}]
    for i, anc in enumerate(ancestors):
        assert set(mask[0, i].nonzero()[:, 0].tolist()) == anc, i
    assert not mask[0, :7, 7].any()  # no real node sees the padding slot


def test_greedy_reference_on_hand_tree():
    tokens, parents, num_nodes = hand_tree()
    # target after root says 'a' (10) -> node 1; after node 1 says 'd' (13) -> node 4 (node 3 has 'c');
    # after node 4 says 'e' (14) -> node 6; after node 6 says 42 -> bonus token
    am = torch.tensor([[10, 13, 0, 0, 14, 0, 42, 0]])
    accept_len, path, next_token = ref.greedy_verify_tree(tokens, parents, num_nodes, am)
    assert accept_len.tolist() == [3] and next_token.tolist() == [42]
    assert path.tolist() == [[0, 1, 4, 6, -1, -1, -1, -1]]
    # both root children match nothing -> nothing accepted, correction token = target's choice at the root
    am = torch.tensor([[12, 0, 0, 0, 0, 0, 0, 0]])
    accept_len, path, next_token = ref.greedy_verify_tree(tokens, parents, num_nodes, am)
    assert accept_len.tolist() == [0] and next_token.tolist() == [12] and path[0, 1] == -1
    # two children of node 1 could not both match; the first matching child in index order wins for 'b' vs 'c'
    parents2 = torch.tensor([[-1, 0, 0]])
    tokens2 = torch.tensor([[0, 5, 5]])
    am2 = torch.tensor([[5, 8, 9]])
    _, path2, next2 = ref.greedy_verify_tree(tokens2, parents2, torch.tensor([3]), am2)
    assert path2.tolist() == [[0, 1, -1]] and next2.tolist() == [8]


def test_greedy_chain_reference():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [9, 2, 3]])
    am = torch.tensor([[1, 2, 3, 4], [1, 7, 3, 4], [1, 2, 3, 4]])
    accept_len, next_token = ref.greedy_verify_chain(draft, am)
    assert accept_len.tolist() == [3, 1, 0] and next_token.tolist() == [4, 7, 1]


def test_chain_references_agree_with_tree_references():
    g = torch.Generator().manual_seed(11)
    B, K, V = 64, 5, 12
    draft = torch.randint(0, V, (B, K), generator=g)
    target = torch.softmax(2 * torch.randn(B, K + 1, V, generator=g), -1)
    draft_probs = torch.softmax(2 * torch.randn(B, K, V, generator=g), -1)
    draft[:, ::2] = target[:, :K:2].argmax(-1)  # some accepts
    u, bu = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    parents, num_nodes = verify.chain_tree(B, K)
    pad = lambda t: torch.cat([torch.zeros_like(t[:, :1]), t], 1)  # noqa: E731 - add the root row
    for q in (None, draft_probs):
        al, nt = ref.rejection_sample_chain(draft, q, target, u, bu)
        al2, path, nt2 = ref.rejection_sample_tree(pad(draft), parents, num_nodes, target,
                                                   None if q is None else pad(q), pad(u), bu)
        assert torch.equal(al, al2) and torch.equal(nt, nt2)
        assert (path[:, 1:] == torch.where(torch.arange(1, K + 1) <= al[:, None], torch.arange(1, K + 1), -1)).all()
        assert 0 < al.float().mean() < K  # the case mixes accepts and rejects
    am = target.argmax(-1)
    al, nt = ref.greedy_verify_chain(draft, am)
    al2, _, nt2 = ref.greedy_verify_tree(pad(draft), parents, num_nodes, am)
    assert torch.equal(al, al2) and torch.equal(nt, nt2)


def test_inverse_cdf_sampling():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0]])
    assert ref.sample_inverse_cdf(p, torch.tensor([0.0, 0.5, 0.2])).tolist() == [1, -1, 2]
    assert ref.sample_inverse_cdf(p, torch.tensor([0.49, 0.5, 0.1999])).tolist() == [1, -1, 0]
    assert ref.sample_inverse_cdf(p, torch.tensor([0.9999999, 0.5, 1.0])).tolist() == [3, -1, 2]  # never a zero


# ------------------------------------------------------------------------------------------------ losslessness
def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=p.numel()).double()
    return 0.5 * (counts / counts.sum() - p.double()).abs().sum().item()


def first_token(tokens, path, accept_len, next_token):
    rows = torch.arange(tokens.shape[0])
    return torch.where(accept_len > 0, tokens[rows, path[:, 1].clamp_min(0)], next_token)


def second_token(tokens, path, accept_len, next_token):
    rows = torch.arange(tokens.shape[0])
    return torch.where(accept_len > 1, tokens[rows, path[:, 2].clamp_min(0)], next_token)


TOL = 0.02  # sampling noise at M=100k over V=8 is ~0.004 TV


def lossless_tree_case(iid: bool, M: int = 100_000, V: int = 8, seed: int = 0):
    """Root with 3 candidates, each with 2 candidates of its own. Target: p1 at the root, P2[x] after token x.

    iid=False: deterministic top-k candidates (draft_probs=None). iid=True: candidates drawn i.i.d. from q."""
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    P2 = torch.softmax(1.5 * torch.randn(V, V, generator=g), -1)  # [x1, x2]
    noise = 2.0 if iid else 1.0  # a draft that is roughly right (sampled drafts get a worse one)
    q1 = torch.softmax(p1.log() + noise * torch.randn(V, generator=g), -1)
    Q2 = torch.softmax(P2.log() + noise * torch.randn(V, V, generator=g), -1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]).expand(M, -1)
    N = parents.shape[1]
    tokens = torch.zeros(M, N, dtype=torch.long)
    if iid:
        tokens[:, 1:4] = torch.multinomial(q1, 3 * M, replacement=True, generator=g).view(M, 3)
    else:
        tokens[:, 1:4] = q1.topk(3).indices
    for c, kids in ((1, (4, 5)), (2, (6, 7)), (3, (8, 9))):
        q = Q2[tokens[:, c]]  # [M, V]
        picked = torch.multinomial(q, 2, replacement=True, generator=g) if iid else q.topk(2).indices
        tokens[:, kids[0]], tokens[:, kids[1]] = picked[:, 0], picked[:, 1]
    target = torch.empty(M, N, V)
    target[:, 0] = p1
    for c in (1, 2, 3):
        target[:, c] = P2[tokens[:, c]]
    target[:, 4:] = torch.softmax(torch.randn(V, generator=g), -1)  # depth 2: irrelevant to the first two tokens
    draft = None
    if iid:
        draft = torch.zeros(M, N, V)
        draft[:, 1:4] = q1
        for c in range(4, N):
            draft[:, c] = Q2[tokens[:, int(parents[0, c])]]
    u = torch.rand(M, N, generator=g)
    bu = torch.rand(M, generator=g)
    return tokens, parents, torch.full((M,), N), target, draft, u, bu, p1, P2


@pytest.mark.parametrize("iid", [False, True], ids=["topk-onehot", "iid-draft-probs"])
def test_rejection_sample_tree_is_lossless(iid):
    tokens, parents, num_nodes, target, draft, u, bu, p1, P2 = lossless_tree_case(iid)
    accept_len, path, next_token = ref.rejection_sample_tree(tokens, parents, num_nodes, target, draft, u, bu)
    assert 0.2 < (accept_len > 0).float().mean() < 0.95  # the test exercises both branches
    x1 = first_token(tokens, path, accept_len, next_token)
    assert tv(x1, p1) < TOL
    # given an accepted first draft x1, the second emitted token must follow P2[x1]
    accepted = accept_len > 0
    x2 = second_token(tokens, path, accept_len, next_token)
    for x in x1[accepted].unique():
        sel = accepted & (x1 == x)
        if sel.sum() > 5000:
            assert tv(x2[sel], P2[x]) < 2 * TOL, int(x)
    # a biased sampler fails the same test: "always accept" (u = 0 accepts every candidate with p[x] > 0)
    accept_len_b, path_b, next_b = ref.rejection_sample_tree(tokens, parents, num_nodes, target, draft,
                                                           torch.zeros_like(u), bu)
    assert tv(first_token(tokens, path_b, accept_len_b, next_b), p1) > 5 * TOL


def naive_chain_first_token(draft, q, target, u, bu):
    """Biased on purpose: after a rejection it samples from p instead of the residual max(p - q, 0)."""
    rows = torch.arange(draft.shape[0])
    x = draft[:, 0]
    accept = u[:, 0] * q[rows, 0, x] < target[rows, 0, x]
    return torch.where(accept, x, ref.sample_inverse_cdf(target[:, 0], bu))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sample_chain_is_lossless(with_draft_probs):
    g = torch.Generator().manual_seed(3)
    M, K, V = 100_000, 3, 8
    p1 = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    q1 = torch.softmax(p1.log() + torch.randn(V, generator=g), -1)
    if with_draft_probs:
        draft = torch.multinomial(q1, M, replacement=True, generator=g).view(M, 1)
        q = q1.expand(M, 1, V)
    else:
        draft = q1.argmax().expand(M, 1)
        q = torch.nn.functional.one_hot(draft, V).float()
    draft = torch.cat([draft, torch.randint(0, V, (M, K - 1), generator=g)], 1)
    q = torch.cat([q, torch.softmax(torch.randn(M, K - 1, V, generator=g), -1)], 1)
    target = torch.cat([p1.expand(M, 1, V), torch.softmax(torch.randn(M, K, V, generator=g), -1)], 1)
    u, bu = torch.rand(M, K, generator=g), torch.rand(M, generator=g)
    accept_len, next_token = ref.rejection_sample_chain(draft, q if with_draft_probs else None, target, u, bu)
    x1 = torch.where(accept_len > 0, draft[:, 0], next_token)
    assert 0.1 < (accept_len > 0).float().mean() < 0.9
    assert tv(x1, p1) < TOL
    assert tv(naive_chain_first_token(draft, q, target, u, bu), p1) > 3 * TOL
    al_b, nt_b = ref.rejection_sample_chain(draft, q if with_draft_probs else None, target, torch.zeros_like(u), bu)
    assert tv(torch.where(al_b > 0, draft[:, 0], nt_b), p1) > 5 * TOL


# ------------------------------------------------------------------------------------------------ triton vs reference
@pytest.mark.parametrize("seed,B,N,V,style", SHAPES)
def test_tree_mask_triton_matches_reference(seed, B, N, V, style):
    g = torch.Generator().manual_seed(seed)
    _, parents, num_nodes = random_tree(g, B, N, V, style)
    assert_same(verify.build_tree_mask(parents, num_nodes, backend="triton"), ref.build_tree_mask(parents, num_nodes))


@pytest.mark.parametrize("seed,B,N,V,style", SHAPES)
def test_greedy_tree_triton_matches_reference(seed, B, N, V, style):
    g = torch.Generator().manual_seed(seed)
    tokens, parents, num_nodes = random_tree(g, B, N, V, style)
    am = argmax_that_often_matches(g, tokens, parents, num_nodes, V)
    want = ref.greedy_verify_tree(tokens, parents, num_nodes, am)
    assert_same(verify.greedy_verify_tree(tokens, parents, num_nodes, am, backend="triton"), want)


def test_greedy_tree_triton_edge_cases():
    g = torch.Generator().manual_seed(4)
    B, N, V = 4, 7, 10
    tokens, parents, num_nodes = random_tree(g, B, N, V, "random", pad=False)
    run = lambda ps, am, nn=num_nodes: (  # noqa: E731
        verify.greedy_verify_tree(tokens, ps, nn, am, backend="triton"), ref.greedy_verify_tree(tokens, ps, nn, am))
    got, want = run(parents, torch.full((B, N), V + 1))  # the target never agrees: nothing accepted
    assert_same(got, want)
    assert want[0].tolist() == [0] * B and want[2].tolist() == [V + 1] * B
    chain = torch.arange(-1, N - 1).expand(B, -1).contiguous()
    am = torch.roll(tokens, -1, 1)  # the target agrees with every draft of the chain
    got, want = run(chain, am)
    assert_same(got, want)
    assert want[0].tolist() == [N - 1] * B and want[1].tolist() == [list(range(N))] * B
    assert torch.equal(want[2], am[:, -1])
    got, want = run(parents, am, torch.ones(B, dtype=torch.long))  # root only
    assert_same(got, want)
    assert want[0].tolist() == [0] * B and torch.equal(want[2], am[:, 0])


def test_greedy_chain_triton_matches_reference():
    g = torch.Generator().manual_seed(5)
    for B, K, V in ((1, 0, 8), (1, 1, 8), (4, 5, 6), (8, 7, 3)):  # tiny V: long accepted runs happen
        draft = torch.randint(0, V, (B, K), generator=g)
        am = torch.randint(0, V, (B, K + 1), generator=g)
        am[0, :K] = draft[0]  # all accepted in row 0
        assert_same(verify.greedy_verify_chain(draft, am, backend="triton"), ref.greedy_verify_chain(draft, am))


@pytest.mark.parametrize("seed,B,N,V,style", SHAPES)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_tree_triton_matches_reference(seed, B, N, V, style, with_draft_probs):
    g = torch.Generator().manual_seed(100 + seed)
    tokens, parents, num_nodes = random_tree(g, B, N, V, style)
    target = probs_that_often_accept(g, tokens, parents, num_nodes, V)
    draft = None
    if with_draft_probs:  # row c is the distribution child c was drawn from: shift it to the child's own token
        draft = torch.softmax(torch.randn(B, N, V, generator=g), -1)
        draft.scatter_add_(2, tokens.clamp(0, V - 1)[:, :, None], torch.full((B, N, 1), 0.5))
        draft /= draft.sum(-1, keepdim=True)
    u, bu = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    want = ref.rejection_sample_tree(tokens, parents, num_nodes, target, draft, u, bu)
    got = tk.rejection_sample(tokens, parents, num_nodes, target, draft, u, bu, block_v=16)  # several vocab tiles
    assert_same(got, want)
    assert_same(verify.rejection_sample_tree(tokens, parents, num_nodes, target, draft, u, bu, backend="triton"), want)


def test_rejection_triton_edge_cases():
    g = torch.Generator().manual_seed(7)
    B, N, V = 3, 6, 16
    tokens, parents, num_nodes = random_tree(g, B, N, V, "random", pad=False)
    u, bu = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    run = lambda tp, dp, uu=u, nn=num_nodes: (  # noqa: E731
        ref.rejection_sample_tree(tokens, parents, nn, tp, dp, uu, bu),
        tk.rejection_sample(tokens, parents, nn, tp, dp, uu, bu, block_v=8))

    # all rejected: the target gives zero mass to every candidate token at its parent
    logits = torch.randn(B, N, V, generator=g)
    for b in range(B):
        for c in range(1, N):
            logits[b, parents[b, c], tokens[b, c]] = -float("inf")
    target = torch.softmax(logits, -1)
    want, got = run(target, None)
    assert_same(got, want)
    assert want[0].tolist() == [0] * B
    root_kids = [{int(tokens[b, c]) for c in children(parents, num_nodes, b, 0)} for b in range(B)]
    assert all(int(want[2][b]) not in root_kids[b] for b in range(B))  # residual excludes rejected tokens

    # all accepted on a chain: the target puts all its mass on the next draft token
    chain = torch.arange(-1, N - 1).expand(B, -1).contiguous()
    target = torch.nn.functional.one_hot(torch.roll(tokens, -1, 1), V).float()
    target[:, -1] = torch.softmax(torch.randn(B, V, generator=g), -1)
    want = ref.rejection_sample_tree(tokens, chain, num_nodes, target, None, u, bu)
    assert_same(tk.rejection_sample(tokens, chain, num_nodes, target, None, u, bu, block_v=8), want)
    assert want[0].tolist() == [N - 1] * B and want[1].tolist() == [list(range(N))] * B

    # root only: the next token is a plain sample of target_probs[:, 0]
    target = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    want, got = run(target, None, nn=torch.ones(B, dtype=torch.long))
    assert_same(got, want)
    assert torch.equal(want[2], ref.sample_inverse_cdf(target[:, 0], bu))

    # degenerate residual: q == p and a candidate with q[x] = p[x] = 0 is rejected; p is kept (no NaN, no -1)
    target = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    target[:, 0, tokens[0, 1]] = 0.0
    target[:, 0] /= target[:, 0].sum(-1, keepdim=True)
    want, got = run(target, target.clone())
    assert_same(got, want)
    assert ((want[2] >= 0) & (want[2] < V)).all()
    # uniforms of 1.0 with one-hot drafts and p[x] = 1: rejected, residual is zero, p = one-hot(x) is kept
    target = torch.nn.functional.one_hot(torch.roll(tokens, -1, 1), V).float()
    want, got = run(target, None, uu=torch.ones(B, N))
    assert_same(got, want)
    assert want[0].tolist() == [0] * B and torch.equal(want[2], tokens[:, 1])


def test_rejection_chain_triton_matches_reference():
    g = torch.Generator().manual_seed(9)
    for B, K, V, with_q in ((1, 0, 16, False), (2, 1, 16, True), (5, 4, 24, False), (8, 6, 64, True)):
        draft = torch.randint(0, V, (B, K), generator=g)
        target = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
        target[:, :K].scatter_add_(2, draft[:, :, None], torch.full((B, K, 1), 2.0))
        target /= target.sum(-1, keepdim=True)
        q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if with_q else None
        u, bu = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
        want = ref.rejection_sample_chain(draft, q, target, u, bu)
        assert_same(verify.rejection_sample_chain(draft, q, target, u, bu, backend="triton"), want)


def compaction_case(g, B, H, S, D, L, dtype, contiguous):
    if contiguous:
        cache = torch.randn(B, H, S, D, generator=g).to(dtype)
    else:  # [B, S, H, D] storage seen as [B, H, S, D]
        cache = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    dst = torch.zeros(B, dtype=torch.long)
    src = torch.full((B, L), 10**6)  # unused columns hold garbage
    for b in range(B):
        n = int(lengths[b])
        dst[b] = int(torch.randint(0, S - L + 1, (), generator=g))
        # the accepted path's slots: increasing and >= dst, so they overlap the destination range
        pool = torch.arange(int(dst[b]), min(S, int(dst[b]) + 2 * L))
        src[b, :n] = pool[torch.randperm(len(pool), generator=g)[:n]].sort().values
    return cache, src, lengths, dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_compact_triton_matches_reference(dtype):
    g = torch.Generator().manual_seed(13)
    for B, H, S, D, L, contiguous in ((1, 1, 8, 4, 3, True), (4, 2, 24, 20, 6, False), (8, 3, 40, 8, 9, True)):
        cache, src, lengths, dst = compaction_case(g, B, H, S, D, L, dtype, contiguous)
        want = ref.kv_compact(cache.clone(), src, lengths, dst)
        got = verify.kv_compact(cache, src, lengths, dst, backend="triton")
        assert got.data_ptr() == cache.data_ptr() and torch.equal(got, want)
    # the overlapping move itself: rows 2, 3, 5 of a 6-row cache into 1, 2, 3
    cache = torch.arange(6.0).view(1, 1, 6, 1).repeat(1, 1, 1, 2)
    verify.kv_compact(cache, torch.tensor([[2, 3, 5]]), torch.tensor([3]), torch.tensor([1]), backend="triton")
    assert cache[0, 0, :, 0].tolist() == [0, 2, 3, 5, 4, 5]


def test_triton_kernels_compile_for_sm90():
    """The interpreter accepts code that the compiler rejects (e.g. loop-carried dtype changes): compile every
    kernel variant to a cubin for Hopper, on CPU, in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = "from drafthead.kernels.triton_kernels import compile_for_gpu; print(len(compile_for_gpu(90)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "9"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_gpu_match_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "scripts/bench_kernels.py", "--quick"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_have_clear_errors():
    tokens, parents, num_nodes = hand_tree()
    am = torch.zeros_like(tokens)
    bad = parents.clone()
    bad[0, 3] = 3
    with pytest.raises(ValueError, match=r"parents\[b, i\] must be in 0..i-1.*\[0, 3\]"):
        verify.greedy_verify_tree(tokens, bad, num_nodes, am)
    bad = parents.clone()
    bad[0, 0] = 0
    with pytest.raises(ValueError, match=r"parents\[:, 0\] must be -1"):
        verify.build_tree_mask(bad, num_nodes)
    with pytest.raises(ValueError, match="num_nodes must be in 1..8"):
        verify.build_tree_mask(parents, torch.tensor([9]))
    with pytest.raises(TypeError, match="parents must be torch.int64"):
        verify.build_tree_mask(parents.int(), num_nodes)
    with pytest.raises(ValueError, match=r"target_argmax must have shape \[1, 8\]"):
        verify.greedy_verify_tree(tokens, parents, num_nodes, am[:, :4])
    target = torch.full((1, 8, 12), 1 / 12)
    u, bu = torch.rand(1, 8), torch.rand(1)
    with pytest.raises(ValueError, match="draft tokens must be in 0..11"):
        verify.rejection_sample_tree(tokens, parents, num_nodes, target, None, u, bu)
    with pytest.raises(TypeError, match="target_probs must be torch.float32"):
        verify.rejection_sample_tree(tokens, parents, num_nodes, target.half(), None, u, bu)
    with pytest.raises(ValueError, match=r"draft_tokens must be in 0..11"):
        verify.rejection_sample_chain(torch.tensor([[12]]), None, torch.full((1, 2, 12), 1 / 12), u[:, :1], bu)
    with pytest.raises(ValueError, match="backend must be one of"):
        verify.build_tree_mask(parents, num_nodes, backend="cuda")
    cache = torch.zeros(1, 1, 6, 2)
    with pytest.raises(ValueError, match=r"src_idx\[b, j\] must be >= dst_start\[b\] \+ j"):
        verify.kv_compact(cache, torch.tensor([[2, 1]]), torch.tensor([2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="dst_start must be >= 0 and dst_start \\+ lengths <= 6"):
        verify.kv_compact(cache, torch.tensor([[5, 5]]), torch.tensor([2]), torch.tensor([5]))


def test_backend_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    _, parents, num_nodes = hand_tree()
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        verify.build_tree_mask(parents, num_nodes, backend="triton")
    assert torch.equal(verify.build_tree_mask(parents, num_nodes)[1], ref.build_tree_mask(parents, num_nodes)[1])
