"""The core of ``benchmarks/quality/kv_quality.py`` on a tiny model: teacher-forced segments
through every KV format's engine, scored against bf16 KV, and the one line per format a script
reads."""

from __future__ import annotations

import math
import re

import pytest
import torch
from tiny_models import VOCAB_SIZE, build_tiny_model

from benchmarks.quality.kv_quality import FORMATS, REFERENCE, build_engine, cut_segments, measure

LINE = re.compile(
    r"^kv (?P<name>[\w ]+): kld_mean (?P<mean>\S+) kld_p99 (?P<p99>\S+) "
    r"top1 (?P<top1>[\d.]+)% ppl_ratio (?P<ratio>\S+)$"
)
AGAIN = "bf16 again"  # a second engine of the reference's format: its own pool and forwards


@pytest.mark.slow
def test_each_format_scores_against_bf16_kv_in_one_readable_line(tmp_path):
    folder = str(build_tiny_model("llama3-rope", tmp_path / "llama"))
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(1, VOCAB_SIZE, (3 * 48 + 5,), generator=generator).tolist()
    # 16 of 48 tokens prefilled in chunks of 6 (pages of 16 filled across chunks), 31 scored.
    segments = cut_segments(text, segment=48, context=16, chunk=6)
    assert len(segments.token_ids) == 3 and segments.num_scored == 3 * 31
    engines = {name: build_engine(folder, kv, segments) for name, kv in FORMATS.items()}
    engines[AGAIN] = build_engine(folder, FORMATS[REFERENCE], segments)
    qualities = {quality.name: quality for quality in measure(engines, segments)}

    for name in (REFERENCE, AGAIN):  # the same format, another engine: the very same logits
        assert qualities[name].kld_mean == qualities[name].kld_p99 == 0.0
        assert qualities[name].top1 == 1.0 and qualities[name].ppl_ratio == 1.0
    for name in ("rounding", "fp8", "int8"):
        quality = qualities[name]
        assert 0.0 < quality.kld_mean <= quality.kld_p99 < 1.0, quality
        assert 0.5 < quality.top1 <= 1.0 and abs(math.log(quality.ppl_ratio)) < 0.1, quality
    # 8-bit pages move attention far more than float32 rounding does.
    assert qualities["fp8"].kld_mean > qualities["rounding"].kld_mean
    assert math.isfinite(qualities[REFERENCE].perplexity) and qualities[REFERENCE].perplexity > 1

    for quality in qualities.values():
        match = LINE.match(quality.line())
        assert match is not None, quality.line()
        assert match["name"] == quality.name
        assert float(match["mean"]) == pytest.approx(quality.kld_mean, rel=1e-3, abs=1e-12)
        assert float(match["p99"]) == pytest.approx(quality.kld_p99, rel=1e-3, abs=1e-12)
        assert float(match["top1"]) == pytest.approx(100 * quality.top1, abs=0.01)
        assert float(match["ratio"]) == pytest.approx(quality.ppl_ratio, abs=1e-5)


@pytest.mark.parametrize(
    ("tokens", "segment", "context", "chunk", "message"),
    [
        (40, 48, 16, 8, "do not fill one segment"),
        (96, 48, 47, 8, "leaves no position to score"),
        (96, 48, 0, 8, "leaves no position to score"),
        (96, 48, 16, 0, "chunk must be >= 1"),
    ],
)
def test_segments_refuse_what_leaves_nothing_to_score(tokens, segment, context, chunk, message):
    with pytest.raises(ValueError, match=message):
        cut_segments(list(range(tokens)), segment, context, chunk)


def test_measure_needs_the_reference():
    segments = cut_segments(list(range(96)), 48, 16, 8)
    with pytest.raises(ValueError, match="no 'bf16' engine"):
        measure({}, segments)
