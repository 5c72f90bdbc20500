"""The EAGLE-3 head shipped for the default model (specserve/heads/smollm2-135m-eagle3).

`--speculative-algorithm EAGLE3` with no draft path on the default model drafts with it:
greedy output stays token-identical to plain decoding, and the head is a trained one
(well above a random head's accept length of ~1.0). Other models still need a draft path.
"""
from __future__ import annotations

import pytest

from specserve import Engine
from specserve.bench.spec_compare import spec_counts
from specserve.spec.eagle.shipped_heads import has_shipped_head, shipped_head
from tests.unit.model_utils import EXACT_ON_GPU, held_out_greedy

pytestmark = pytest.mark.slow


def test_the_default_model_drafts_with_its_shipped_head(smollm2_dir, smollm2_engine):
    # fp32 on a GPU too, as the plain engine it is compared with: in bf16 the verify's few-token
    # products and plain decoding's one-token GEMVs round differently (the outputs parted there).
    # The governor is off so that every step drafts: with it (the CUDA default) a request it
    # served plainly has no spec_verify_ct, and the accept length would not be the head's alone.
    engine = Engine("smollm2-135m", log_level="warning", speculative_algorithm="EAGLE3", speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive="off",
                    **EXACT_ON_GPU)
    assert engine.scheduler.spec.proposer.model.config.hidden_size == 576
    want, outs = held_out_greedy(engine, smollm2_engine, 48)
    assert [o["output_ids"] for o in outs] == want
    verifies, plain, accept = spec_counts(outs)
    assert verifies > 0 and plain == 0  # speculation forced: every step drafted
    assert accept > 1.4, accept  # a random head accepts ~nothing (1.0)
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


def test_only_the_catalogue_model_has_a_head(tmp_path, smollm2_dir):
    assert has_shipped_head("smollm2-135m", "EAGLE3") and not has_shipped_head("smollm2-135m", "EAGLE")
    assert not has_shipped_head(str(smollm2_dir), "EAGLE3")  # a path is not matched by name
    assert shipped_head(smollm2_dir, "EAGLE3") is not None  # ... but its conversion marker is
    assert shipped_head(tmp_path, "EAGLE3") is None
