"""Whether a trained draft copies from its context, and training's simulated acceptance beside
what greedy speculative decoding counts, on the same sequences; no engine needed (the verifier
in transformers, the draft in this workflow's own code).

    python benchmarks/bench_copying.py [--configfile FILE ...] [--directory DIR] [--samples 60]
        [--json FILE]

It reads a build made in DIR with the config files given (bench_serving.py: build_config): the
draft, the verifier, the evaluation reference's greedy answers to the held-out prompts of each
set (evaluate/reference.json; prompts with later turns left out), the samples of training's
held-out split (its validation figures' samples) and the first --samples samples it trained on
(prepare/tokenized_data.jsonl, as extraction numbered them). The verifier (float32)
computes each sequence's auxiliary states and its own next token at every position; the draft
unrolls k = evaluate.num_speculative_tokens steps on them, as training does. Per source, over
the answer tokens (of a training sample, its first answer):

- copying: the draft's first drafted token held to the verifier's where the context predicts it
  (the last COPY_NGRAM tokens occurred before, and the token after them then is the verifier's:
  prompt lookup would propose it) and elsewhere. A draft that copies agrees far more often on
  the first.
- acceptance length two ways: every position the anchor of k drafts (training's simulated
  figure) and as greedy speculative decoding walks the answer, each step's anchor the token after
  the last one accepted (vLLM's count), beside what vLLM served on the set (evaluate's
  results.json). Where agreement comes in runs, the walk steps over a run in few steps: the two
  ways part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serving import build_config  # noqa: E402
from workflow_scripts.lib.draft.greedy_walk import walk_answers  # noqa: E402

COPY_NGRAM = 3


def copy_right(ids: list[int], n: int = COPY_NGRAM) -> list[bool]:
    """Per position j: whether the n tokens ending at j occurred before, and the token after
    their latest earlier occurrence is ids[j + 1] (what prompt lookup would have proposed)."""
    right, seen = [False] * len(ids), {}
    for j in range(n - 1, len(ids) - 1):
        key = tuple(ids[j - n + 1 : j + 1])
        right[j] = key in seen and ids[seen[key] + 1] == ids[j + 1]
        seen[key] = j
    return right


def load_draft(directory: Path):
    """The draft checkpoint in ``directory`` as the draft's model, and its draft-to-verifier
    token ids. Drafts of a Llama or Qwen3 layer (not MLA)."""
    import torch

    from workflow_scripts.lib.draft.checkpoint import read_draft_checkpoint
    from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft
    from workflow_scripts.lib.training.init_from import layer_of

    config, tensors = read_draft_checkpoint(directory)
    kind, layer = layer_of(config)
    if kind == "mla":
        sys.exit(f"{directory}: an MLA draft; this benchmark reads Llama and Qwen3 drafts")
    window = (
        layer.get("sliding_window") if "sliding_attention" in layer.get("layer_types", []) else None
    )
    cfg = DraftConfig.from_layer_config(
        layer,
        int(config["draft_vocab_size"]),
        len(config["eagle_aux_hidden_state_layer_ids"]),
        norm_before_residual=config.get("norm_before_residual", True),
        norm_before_fc=config.get("norm_before_fc", False),
        norm_output=config.get("norm_output", False),
        fc_norm=config.get("fc_norm", False),
        num_layers=layer["num_hidden_layers"],
        sliding_window=window,
    )
    d2t = tensors.pop("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    tensors.pop("t2d", None)
    model = Eagle3Draft(cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    model.float().eval()
    return (
        model,
        torch.arange(cfg.draft_vocab_size) + d2t,
        config["eagle_aux_hidden_state_layer_ids"],
    )


def measure(verifier, draft, draft_to_verifier, aux_ids, ids: list[int], start: int, k: int):
    """Counts over the positions predicting ids[start:]: [copy-right positions, draft agreeing
    there, other positions, agreeing there, anchors, drafts accepted at every anchor, walk's
    steps, walk's drafts accepted]."""
    import torch

    x = torch.tensor([ids])
    out = verifier(x, output_hidden_states=True)
    aux = torch.stack([out.hidden_states[i] for i in aux_ids], dim=2)
    verifier_next = out.logits[0].argmax(-1)  # at j: the verifier's token j + 1
    n = len(ids) - 1  # draft position t reads token t + 1 and predicts t + 2 (+ k at step k)
    alive = torch.ones(n, dtype=torch.bool)
    chain = torch.zeros(n, dtype=torch.int64)
    for step, r in enumerate(draft.unroll(aux, x, k)):
        top = draft_to_verifier[draft.lm_head(draft.norm(r[0])).argmax(-1)]
        agree = torch.zeros(n, dtype=torch.bool)
        agree[: n - step] = top[: n - step] == verifier_next[1 + step :]
        if step == 0:
            first = agree
        alive &= agree
        chain += alive.long()
    anchored = torch.zeros(1, n, dtype=torch.bool)  # as training's: t predicts answer token t + 2
    anchored[0, start - 2 : n - 1] = True
    steps, accepted = walk_answers(anchored, chain[None])  # the first step after the prefill's
    a = anchored[0]
    copy = torch.tensor(copy_right(ids)[1:]) & a
    return [
        int(copy.sum()), int((first & copy).sum()), int((a & ~copy).sum()),
        int((first & a & ~copy).sum()), int(a.sum()), int(chain[a].sum()), steps, accepted,
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configfile", type=Path, nargs="+", default=[], help="as to Snakemake")
    ap.add_argument("--directory", type=Path, default=Path("."), help="the build's working dir")
    ap.add_argument("--samples", type=int, default=60, help="trained-on samples to read")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args()
    out = a.json.resolve() if a.json else None

    import torch
    from transformers import AutoModelForCausalLM

    from workflow_scripts.lib.chat.template import load_template
    from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets
    from workflow_scripts.lib.evaluation.records import EvalResults, References
    from workflow_scripts.lib.hidden_states.manifest import load_manifest
    from workflow_scripts.lib.training.loader import split_samples

    cfg, layout = build_config(a.directory, a.configfile)
    p = cfg.evaluate
    verifier_dir = layout.verifier(cfg.verifier)
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    draft, draft_to_verifier, aux_ids = load_draft(layout.train.draft)
    reference = References.read(layout.evaluate.reference)
    template = load_template(verifier_dir, p.chat_template)
    prompts = load_prompt_sets(p.eval_prompts.root, template, p.max_prompts, p.max_model_len_tokens)
    served = [(q.set, str(q.id)) for q in reference.prompts]
    if served != [(q["set"], str(q["id"])) for q in prompts]:
        sys.exit(f"{layout.evaluate.reference}: served other prompts than these settings name")
    sources: dict[str, list[tuple[list[int], int]]] = {}
    for q, output in zip(prompts, reference.runs["baseline"].outputs):
        if not q["later_turns"]:
            ids = list(q["prompt_token_ids"])
            sources.setdefault(f"held-out: {q['set']}", []).append((ids + output, len(ids)))
    skipped = set(load_manifest(layout.extract.manifest).skipped_too_long)
    with layout.prepare.tokenized.open() as f:
        rows = [json.loads(line) for i, line in enumerate(f) if i not in skipped]
    trained, held_out = split_samples(len(rows), cfg.train.validation_fraction, cfg.train.seed)
    for name, ids in (
        ("training's held-out split", held_out),
        ("trained on", trained[: a.samples]),
    ):
        for i in ids:
            mask = rows[i]["loss_mask"]
            if 1 in mask[1:]:  # the first answer, up to its end (the walk stays in one turn)
                start = mask.index(1, 1)
                end = mask.index(0, start) if 0 in mask[start:] else len(mask)
                sources.setdefault(name, []).append((rows[i]["input_ids"][:end], start))
    k = p.num_speculative_tokens
    results = (
        EvalResults.read(layout.evaluate.results) if layout.evaluate.results.is_file() else None
    )
    figures = {}
    with torch.no_grad():
        for name, seqs in sources.items():
            c = [0] * 8
            for ids, start in seqs:
                c = [a + b for a, b in zip(c, measure(verifier, draft, draft_to_verifier,
                                                      aux_ids, ids, start, k))]  # fmt: skip
            served = None
            if results is not None and name.startswith("held-out: "):
                run = getattr(results.sets[name.removeprefix("held-out: ")], "eagle3", None)
                served = run.mean_acceptance_length if run is not None else None
            figures[name] = {
                "sequences": len(seqs),
                "answer_tokens": c[4],
                "copy_right": c[0],
                "first_agrees_where_copy_right": c[1] / max(c[0], 1),
                "first_agrees_elsewhere": c[3] / max(c[2], 1),
                "every_position_an_anchor": 1 + c[5] / c[4],
                "greedy_walk": 1 + c[7] / c[6],
                "greedy_walk_steps": c[6],
                "served": served,
            }
    print(
        f"k = {k}; copy right: the last {COPY_NGRAM} tokens seen before and followed then by the "
        "verifier's token\n\n| source | sequences | answer tokens | copy right at | the draft's "
        "first token agrees there | elsewhere | acceptance length, every position an anchor "
        "| as greedy decoding walks | served by vLLM |\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, f in figures.items():
        served = "" if f["served"] is None else f"{f['served']:.3f}"
        print(
            f"| {name} | {f['sequences']} | {f['answer_tokens']} | {f['copy_right']} "
            f"| {f['first_agrees_where_copy_right']:.3f} | {f['first_agrees_elsewhere']:.3f} "
            f"| {f['every_position_an_anchor']:.3f} | {f['greedy_walk']:.3f} | {served} |"
        )
    if out is not None:
        out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
