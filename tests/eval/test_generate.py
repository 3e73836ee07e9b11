"""KV-cached decoding against full forwards, for every residual strategy."""

import pytest
import torch
from eval_helpers import STRATEGIES, random_decoder

from mhar_lightning.eval.generate import generate, sample, stream_text
from mhar_lightning.kv_cache import KVCache


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cached_forward_matches_full_forward(strategy):
    model = random_decoder(strategy)
    tokens = torch.randint(0, 256, (2, 20))
    full = model(tokens)
    cache = KVCache(model.config, 2, 20, "cpu", torch.float32)
    pieces = [model(tokens[:, :7], cache), model(tokens[:, 7:8], cache), model(tokens[:, 8:], cache)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_cached_generation_equals_uncached(strategy):
    model = random_decoder(strategy)
    prompt = [5, 17, 200, 3, 99]
    cached = list(generate(model, prompt, 12))
    assert cached == list(generate(model, prompt, 12, use_cache=False))
    assert len(cached) == 12
    ids = prompt + cached[:-1]  # the last greedy token is the argmax of an independent full forward
    assert cached[-1] == int(model(torch.tensor([ids]))[0, -1].argmax())
    sampled = [  # sampling draws from the same distributions with and without the cache
        list(generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(1), use_cache=c))
        for c in (True, False)
    ]
    assert sampled[0] == sampled[1]
    assert len(set(sampled[0])) > 3


def test_generation_stops_at_stop_token_and_max_seq_len():
    model = random_decoder("mhar-block")
    first = next(generate(model, [1, 2, 3], 5))
    assert list(generate(model, [1, 2, 3], 5, stop=first)) == [first]
    assert len(list(generate(model, list(range(60)), 50))) == model.config.max_seq_len - 60
    with pytest.raises(ValueError, match="the prompt has 64 tokens; the model reads at most 64"):
        next(generate(model, list(range(64)), 5))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_new_tokens": -5}, "max_new_tokens must be 0 or more, got -5"),
        ({"temperature": -1.0}, r"temperature must be 0 \(greedy\) or more, got -1.0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be 1 or more"),
        ({"temperature": 1.0, "top_k": -3}, "top_k must be 1 or more"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"prompt": list(range(64))}, "the prompt has 64 tokens; the model reads at most 64"),
    ],
)
def test_generate_refuses_bad_options_when_called(options, message):
    """The call itself refuses them, before any token is asked for, so a command can refuse before printing."""
    model = random_decoder("sum")
    arguments = {"prompt": [1, 2, 3], "max_new_tokens": 5, **options}
    with pytest.raises(ValueError, match=message):
        generate(model, arguments.pop("prompt"), arguments.pop("max_new_tokens"), **arguments)


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, 2, None, generator)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, 1.0, None, 0.7, generator)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7, so the second token is needed; 0.8 >= 0.7, so not the third
    assert int(sample(logits, 0.0, None, None, generator)) == 0


def test_stream_text_holds_back_partial_utf8():
    from mhar_lightning.data.tokenizer import ByteTokenizer

    ids = list("é!".encode())
    pieces = list(stream_text(iter(ids), ByteTokenizer().decode))
    assert pieces == ["é", "!"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton routing kernels)")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cached_decoding_on_gpu(strategy):
    model = random_decoder(strategy).cuda()
    tokens = torch.randint(0, 256, (2, 20), device="cuda")
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-1)):
        model = model.to(dtype)
        cache = KVCache(model.config, 2, 20, "cuda", dtype)
        cached = torch.cat([model(tokens[:, :7], cache), model(tokens[:, 7:8], cache), model(tokens[:, 8:], cache)], 1)
        torch.testing.assert_close(cached.float(), model(tokens).float(), rtol=tolerance, atol=tolerance)
    model = model.float()
    prompt = [5, 17, 200, 3, 99]
    assert list(generate(model, prompt, 12)) == list(generate(model, prompt, 12, use_cache=False))
