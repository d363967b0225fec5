"""`python -m server.ray`'s flags become the deployment the same way `python -m server`'s become
one process: the model's sampling defaults and the HTTP settings carry over (no Ray needed)."""

from __future__ import annotations

from server.cli import build_parser, generation_defaults
from server.ray.cli import build_ray_parser, deploy_parts


def test_flags_carry_the_models_sampling_defaults_and_settings(smollm2_lm):
    flags = ["--model", "smollm2-135m-instruct", "--stall-timeout", "7", "--no-web-ui"]
    flags += ["--activation-dtype", "float32", "--kv-cache-dtype", "float32"]
    args = build_ray_parser().parse_args([*flags, "--disaggregated", "--prefill-replicas", "2"])
    spec, _, card, settings = deploy_parts(args)
    one = build_parser().parse_args(flags)
    expected = generation_defaults(smollm2_lm, one.generation_config, None)
    assert expected  # SmolLM2's preset (temperature, top_p): not OpenAI's defaults
    assert dict(card.default_sampling_params) == dict(expected)
    assert (settings.stall_timeout, settings.web_ui) == (7, False)
    assert (spec.disaggregated, spec.prefill_replicas, spec.decode_replicas) == (True, 2, 1)
    assert card.engine == "disaggregated"
    # The replicas load the model as asked (each flag of load_model reaches EngineSpec).
    assert (spec.engine.activation_dtype, spec.engine.kv_cache_dtype) == ("float32", "float32")
