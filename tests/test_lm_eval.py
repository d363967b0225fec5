"""lm-evaluation-harness (`local-completions`) runs a multiple-choice task from a local file
against a real server; each choice's loglikelihood it reports equals transformers' (the oracle,
on the same tiny random Llama) within 1e-4.

lm_eval is not in the test extra (it pulls in datasets, pandas, pyarrow, scipy and
scikit-learn): this test runs where it is installed (`pip install lm_eval`) and skips elsewhere.
"""

from __future__ import annotations

import json

import pytest

from models import load_model
from tests.helpers.model_files import small_config, write_hf_checkpoint
from tests.helpers.oracles import hf_logprobs
from tests.helpers.servers import run_server

lm_eval = pytest.importorskip("lm_eval")

TOL = 1e-4
QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " a fish"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Cats say", "choices": [" meow", " woof", " moo", " quack"], "answer": 0},
]
TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import LlamaConfig

    ckpt = tmp_path / "model"
    ref = write_hf_checkpoint(ckpt, small_config(LlamaConfig, tie_word_embeddings=False))
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))

    lm = load_model(str(ckpt))
    with run_server(lm, engine_options={"max_num_batched_tokens": 8}) as live:
        client = LocalCompletionsAPI(
            model=lm.name,
            base_url=live.url("/v1/completions"),
            tokenizer_backend="huggingface",
            tokenizer=str(ckpt),
            max_length=256,
            max_retries=1,
        )
        out = simple_evaluate(
            model=client,
            tasks=["tiny_mc"],
            # Only the local task: indexing lm_eval's thousands of built-in task files costs
            # most of this test's time otherwise.
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            log_samples=True,
        )
    samples = out["samples"]["tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx, cont = client._encode_pair(context, continuation)
            ids = ctx + cont
            want = hf_logprobs(ref, ids)
            oracle = sum(want[p - 1, ids[p]].item() for p in range(len(ctx), len(ids)))
            assert abs(resp[0][0] - oracle) <= TOL, (context, continuation)
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
