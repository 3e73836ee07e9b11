"""The reference depth routing against a direct stacked einsum formula in fp64."""

import pytest
import torch
from mhar_lightning.kernels import RouteQuery, depth_route, depth_route_lse, merge_source
from mhar_lightning.kernels.reference import depth_logits, depth_weights


def einsum_route(sources, query, norm_weight, heads, eps=1e-6):
    """The DESIGN.md formula written the obvious (stacked, quadratic-memory) way."""
    v = torch.stack(list(sources))  # [S, ..., d]
    d = v.shape[-1]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    logits = torch.einsum("s...hc,hc->s...h", keys.unflatten(-1, (heads, d // heads)), query.view(heads, -1))
    alpha = logits.softmax(dim=0)
    return torch.einsum("s...h,s...hc->...hc", alpha, v.unflatten(-1, (heads, d // heads))).flatten(-2)


@pytest.mark.parametrize("n_sources,d,heads", [(1, 8, 1), (3, 12, 3), (5, 16, 4), (7, 24, 8), (4, 10, 10)])
def test_matches_einsum_in_fp64(n_sources, d, heads):
    g = torch.Generator().manual_seed(n_sources * 100 + d)
    sources = [torch.randn(2, 3, d, dtype=torch.float64, generator=g) * (i + 1) for i in range(n_sources)]
    query = torch.randn(d, dtype=torch.float64, generator=g)
    norm_weight = 1 + 0.5 * torch.randn(d, dtype=torch.float64, generator=g)
    out = depth_route(sources, query, norm_weight, heads)
    torch.testing.assert_close(out, einsum_route(sources, query, norm_weight, heads), rtol=1e-12, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    d, heads = 8, 2
    sources = [torch.randn(2, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3)]
    query = torch.randn(d, dtype=torch.float64, generator=g, requires_grad=True)
    norm_weight = torch.randn(d, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, w, *s: depth_route(s, q, w, heads), (query, norm_weight, *sources))


def test_log_sum_exp_and_several_queries_match_einsum():
    g = torch.Generator().manual_seed(3)
    d, heads = 12, 3
    sources = [torch.randn(2, 3, d, dtype=torch.float64, generator=g) * (i + 1) for i in range(4)]
    query, norm_weight = torch.randn(2, d, dtype=torch.float64, generator=g), torch.rand(2, d, dtype=torch.float64)
    out, lse = depth_route_lse(sources, query, norm_weight, heads)
    for k in range(2):
        torch.testing.assert_close(out[k], einsum_route(sources, query[k], norm_weight[k], heads), rtol=1e-12, atol=0)
        logits = depth_logits(sources, query[k], norm_weight[k], heads)
        torch.testing.assert_close(lse[k], logits.exp().sum(-1).log(), rtol=1e-12, atol=0)


def test_merging_a_source_equals_routing_over_all():
    """Routing over S - 1 sources and merging the last through the log-sum-exp is the route over all S,
    in value and gradient (checked against the direct formula and by gradcheck)."""
    g = torch.Generator().manual_seed(4)
    d, heads = 8, 2
    sources = [torch.randn(2, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(4)]
    query = torch.randn(d, dtype=torch.float64, generator=g, requires_grad=True)
    norm_weight = (1 + 0.3 * torch.randn(d, dtype=torch.float64, generator=g)).requires_grad_()

    def merged(q, w, *s):
        mix, lse = depth_route_lse(s[:-1], q, w, heads)
        return merge_source(mix, lse, s[-1], q, w, heads)

    torch.testing.assert_close(merged(query, norm_weight, *sources), einsum_route(sources, query, norm_weight, heads))
    assert torch.autograd.gradcheck(merged, (query, norm_weight, *sources))


def test_zero_query_is_uniform_mean():
    sources = [torch.randn(4, 16) for _ in range(5)]
    out = depth_route(sources, torch.zeros(16), torch.ones(16), heads=4)
    torch.testing.assert_close(out, torch.stack(sources).mean(0))


def test_weights_sum_to_one_and_follow_a_large_query():
    sources = [torch.randn(6, 8) for _ in range(4)]
    query = 50 * sources[2][0] / sources[2][0].norm()
    w = depth_weights([s[:1] for s in sources], query, torch.ones(8), heads=1)
    assert w.shape == (1, 1, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1))
    assert w[0, 0].argmax() == 2


def test_mixed_dtypes_promote():
    sources = [torch.randn(3, 8), torch.randn(3, 8).bfloat16()]
    out = depth_route(sources, torch.randn(8), torch.ones(8), heads=2)
    assert out.dtype == torch.float32
    ref = einsum_route([s.double() for s in sources], torch.zeros(8).double(), torch.ones(8).double(), 2)
    assert ref.shape == out.shape


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="heads=3 must divide d_model=64"):
        depth_route([torch.randn(2, 64)], torch.zeros(64), torch.ones(64), heads=3)


def test_route_query_is_taken_whole_or_made_of_its_parts():
    """A RouteQuery routes as its four parts do; one mixed with loose parts, or a query without its gain and heads,
    is refused naming the fix."""
    g = torch.Generator().manual_seed(5)
    sources = [torch.randn(2, 8, dtype=torch.float64, generator=g) for _ in range(3)]
    query = torch.randn(2, 8, dtype=torch.float64, generator=g)
    gain = torch.rand(2, 8, dtype=torch.float64, generator=g)
    route = RouteQuery(query, gain, 2, 1e-5)
    assert route.count == 2 and route[1].count == 1
    torch.testing.assert_close(depth_route(sources, route), depth_route(sources, query, gain, 2, 1e-5), rtol=0, atol=0)
    with pytest.raises(TypeError, match="pass a RouteQuery alone"):
        depth_route(sources, route, heads=2)
    with pytest.raises(TypeError, match="needs norm_weight and heads"):
        depth_route(sources, query)
    with pytest.raises(ValueError, match="heads=3 must divide d_model=8"):
        RouteQuery(query, gain, 3)
