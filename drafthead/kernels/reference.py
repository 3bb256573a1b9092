"""Verify-side math in plain PyTorch: the spec that the Triton kernels must reproduce.

Tree convention (a chain is the case parents[i] = i - 1). Per request b there are N node slots:
- node 0 is the root = the last already-accepted token (known, not a draft); nodes 1.. are draft tokens;
- `parents [B, N]` int64, parents[:, 0] = -1 and parents[b, i] < i (topological order);
- `tokens [B, N]` int64 (tokens[:, 0] is never read);
- `num_nodes [B]` int64: slots i >= num_nodes[b] are padding and ignored.
Children of a node are tried in increasing node index. Because every child has a larger index than its
parent, one left-to-right sweep over the nodes visits exactly the candidates the tree walk would try, in
order: at node c we only act when parents[c] is the current node. All functions below are written as that
sweep, vectorised over the batch; the Triton kernels run the same sweep with one program per request.

Inputs are assumed valid here; `drafthead.kernels.verify` checks them before dispatching.
"""
from __future__ import annotations

import torch


def build_tree_mask(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask and depth of each node, for one target forward over the whole tree.

    mask[b, i, j] = j is i or an ancestor of i; depth[b, 0] = 0. The runtime uses
    positions = prefix_len[:, None] + depth. Padding slots i >= num_nodes[b] get depth 0 and a row and column
    that are False except mask[b, i, i] = True, so an attention row of a padding query is never empty (no NaN)
    and no real node ever attends to a padding slot.
    """
    B, N = parents.shape
    rows = torch.arange(B, device=parents.device)
    valid = torch.arange(N, device=parents.device) < num_nodes[:, None]  # [B, N]
    mask = torch.zeros(B, N, N, dtype=torch.bool, device=parents.device)
    depth = torch.zeros(B, N, dtype=torch.long, device=parents.device)
    for i in range(N):
        has_parent = valid[:, i] & (parents[:, i] >= 0)  # [B] false for the root and padding
        par = torch.where(has_parent, parents[:, i], 0)  # [B] (padding slots may hold anything)
        # a node sees what its parent sees, plus itself (parents come first: parents[i] < i)
        mask[:, i] = mask[rows, par] & has_parent[:, None]  # [B, N]
        mask[:, i, i] = True
        depth[:, i] = torch.where(has_parent, depth[rows, par] + 1, 0)
    return mask, depth


def greedy_verify_tree(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy (temperature 0) tree acceptance.

    From the root, accept the first child (lowest index) whose token equals the target's argmax at the current
    node, and repeat. Returns accept_len [B] (accepted drafts, root excluded), path [B, N] (accepted node
    indices starting with 0, padded with -1) and next_token [B] = target_argmax at the last accepted node.
    """
    B, N = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)  # current node
    accept_len = torch.zeros(B, dtype=torch.long, device=tokens.device)
    path = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    want = target_argmax[:, 0]  # [B] token the target emits after the current node
    for c in range(1, N):
        accept = (parents[:, c] == cur) & (c < num_nodes) & (tokens[:, c] == want)  # [B]
        path[rows[accept], accept_len[accept] + 1] = c
        accept_len += accept
        cur = torch.where(accept, c, cur)
        want = target_argmax[rows, cur]
    return accept_len, path, want


def greedy_verify_chain(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance: longest prefix with draft_tokens[:, k] == target_argmax[:, k].

    draft_tokens [B, K], target_argmax [B, K+1] (position k = the target's choice after k accepted drafts).
    Returns accept_len [B] and next_token [B] = target_argmax[b, accept_len[b]].
    """
    K = draft_tokens.shape[1]
    match = (draft_tokens == target_argmax[:, :K]).long()  # [B, K]
    accept_len = match.cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target_argmax.gather(1, accept_len[:, None])[:, 0]
    return accept_len, next_token


def sample_inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token t = first index with cdf[t] > u * cdf[-1] (p may be unnormalised). p [B, V], u [B] -> [B].

    The first such index always has p[t] > 0. If rounding leaves no index (u close to 1), take the last token
    with p > 0; an all-zero p gives -1 (not a distribution: the caller passed invalid probabilities).
    """
    V = p.shape[-1]
    cdf = p.cumsum(dim=-1)  # [B, V]
    threshold = u * cdf[:, -1]  # [B]
    first = (cdf <= threshold[:, None]).sum(dim=-1)  # cdf is non-decreasing: count = first index above
    vocab = torch.arange(V, device=p.device)
    last_positive = torch.where(p > 0, vocab, -1).amax(dim=-1)  # [B]
    return torch.where(first < V, first, last_positive)


def rejection_sample_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate recursive rejection sampling over a token tree.

    At the current node u, p = target_probs[u]. Each child c of u, in index order, with x = tokens[c] and
    q = draft_probs[c] (the distribution x was drawn from) or one-hot(x) when draft_probs is None
    (deterministic top-k candidates): accept if uniforms[c] * q[x] < p[x] (u < p/q); on accept move to c
    (p = target_probs[c]); on reject p <- normalize(max(p - q, 0)) and try the next child. When no child is
    accepted, next_token is drawn from the current p by inverse CDF with bonus_uniforms[b].
    Degenerate case: if max(p - q, 0) sums to 0 (only possible when p <= q everywhere, e.g. p == q and a
    rejected token with q[x] = p[x] = 0, or uniforms of 1.0), p is kept as it was before the subtraction.
    The emitted tokens (accepted drafts, then next_token) are distributed exactly as if drawn from the target.

    target_probs [B, N, V] f32, draft_probs [B, N, V] f32 | None, uniforms [B, N] f32 in [0, 1) (column 0
    unused), bonus_uniforms [B] f32. Returns accept_len [B], path [B, N] (padded with -1), next_token [B].
    """
    accept_len, path, p = rejection_walk_tree(tokens, parents, num_nodes, target_probs, draft_probs, uniforms)
    return accept_len, path, sample_inverse_cdf(p, bonus_uniforms)


def rejection_walk_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accept/reject walk of `rejection_sample_tree`: (accept_len, path, p [B, V] to draw next_token from)."""
    B, N, V = target_probs.shape
    rows = torch.arange(B, device=tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)
    accept_len = torch.zeros(B, dtype=torch.long, device=tokens.device)
    path = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    p = target_probs[:, 0]  # [B, V] current distribution (target at the current node, or a residual)
    for c in range(1, N):
        is_candidate = (parents[:, c] == cur) & (c < num_nodes)  # [B]
        x = tokens[:, c].clamp(0, V - 1)  # padding slots may hold anything
        if draft_probs is None:
            q = torch.nn.functional.one_hot(x, V).to(p.dtype)  # [B, V]
        else:
            q = draft_probs[:, c]  # [B, V]
        accept = is_candidate & (uniforms[:, c] * q[rows, x] < p[rows, x])
        reject = is_candidate & ~accept
        residual = (p - q).clamp_min(0)  # [B, V]
        mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
        p = torch.where(accept[:, None], target_probs[:, c], torch.where(reject[:, None], residual, p))
        path[rows[accept], accept_len[accept] + 1] = c
        accept_len += accept
        cur = torch.where(accept, c, cur)
    return accept_len, path, p


def rejection_sample_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a chain (Leviathan et al. 2023, Chen et al. 2023).

    Draft k (x = draft_tokens[:, k], drawn from q = draft_probs[:, k], or one-hot when None) is accepted if
    uniforms[:, k] * q[x] < p[x] with p = target_probs[:, k]; at the first rejection the next token is drawn
    from normalize(max(p - q, 0)) (p itself if that sums to 0); if all K are accepted, from target_probs[:, K].
    draft_tokens [B, K], draft_probs [B, K, V] | None, target_probs [B, K+1, V], uniforms [B, K],
    bonus_uniforms [B]. Returns accept_len [B] and next_token [B].
    """
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    rows = torch.arange(B, device=draft_tokens.device)
    accept_len = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    running = torch.ones(B, dtype=torch.bool, device=draft_tokens.device)  # no rejection yet
    final_p = target_probs[:, K].clone()  # [B, V] distribution of next_token
    for k in range(K):
        x = draft_tokens[:, k]
        p = target_probs[:, k]  # [B, V]
        q = torch.nn.functional.one_hot(x, V).to(p.dtype) if draft_probs is None else draft_probs[:, k]
        accept = uniforms[:, k] * q[rows, x] < p[rows, x]
        rejected_now = running & ~accept
        residual = (p - q).clamp_min(0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
        final_p = torch.where(rejected_now[:, None], residual, final_p)
        accept_len += running & accept
        running = running & accept
    return accept_len, sample_inverse_cdf(final_p, bonus_uniforms)


def kv_compact(
    cache: torch.Tensor, src_idx: torch.Tensor, lengths: torch.Tensor, dst_start: torch.Tensor
) -> torch.Tensor:
    """Move K/V entries of the accepted path into a contiguous prefix, in place.

    For each b and j < lengths[b]: cache[b, :, dst_start[b] + j] = cache[b, :, src_idx[b, j]].
    cache [B, H, S, D], src_idx [B, L] int64 (src_idx[b, j] >= dst_start[b] + j), lengths [B], dst_start [B].
    All sources are read before any write, so overlapping ranges are safe. Returns cache.
    """
    for b in range(cache.shape[0]):
        n, d = int(lengths[b]), int(dst_start[b])
        rows = cache[b, :, src_idx[b, :n]]  # [H, n, D] advanced indexing copies: sources read first
        cache[b, :, d : d + n] = rows
    return cache
