"""Could a layer-skipping self-draft (the target with some decoder layers left out, no training) be cheaper than
the 4-bit self-draft at a similar α? (docs/RESULTS.md §0k.) The greedy token of the float32 target with layers
dropped, against the full target's, teacher-forced on the full target's own greedy continuations of the 6 tuning
prompts (64 tokens each): at T=0 that is α for a draft fed the target's prefix. Drops one layer at a time, then the
n layers whose single drop cost least. Writes JSON to the path given (default: stdout only).
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/layer_skip_agreement.py docs/layer-skip.json"""
import json
import sys

import torch

from engine.models import load_model

torch.set_num_threads(1)
model, tok = load_model("embedded", torch.device("cpu"), torch.float32)
rows = [json.loads(line) for line in open("data/tuning_prompts.jsonl")]
layers = model.model.layers
seqs = []  # (prompt length, prompt + the target's greedy continuation [1, T])
with torch.inference_mode():
    for row in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        seqs.append((ids.shape[1], model.generate(ids, max_new_tokens=64, do_sample=False)))


def agreement(keep: list[int]) -> float:
    """The share of continuation positions where the target run on layers `keep` picks the full target's token."""
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    for j, layer in enumerate(model.model.layers):  # the attention's cache slot follows its place in the stack
        layer.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(keep)
    same = total = 0
    try:
        with torch.inference_mode():
            for start, seq in seqs:
                pred = model(seq, use_cache=False).logits[0, start - 1:-1].argmax(-1)
                same += int((pred == seq[0, start:]).sum())
                total += seq.shape[1] - start
    finally:
        model.model.layers = layers
        for j, layer in enumerate(layers):
            layer.self_attn.layer_idx = j
        model.config.num_hidden_layers = len(layers)
    return same / total


n_layers = len(layers)
report = {"layers": n_layers, "positions": sum(s.shape[1] - p for p, s in seqs),
          "full": agreement(list(range(n_layers))), "drop_one": {}, "drop_cheapest": {}}
report["drop_one"] = {d: round(agreement([i for i in range(n_layers) if i != d]), 4) for d in range(n_layers)}
order = sorted(report["drop_one"], key=report["drop_one"].get, reverse=True)
for n in (2, 4, 6, 8, 10, 12, 15):
    dropped = set(order[:n])
    report["drop_cheapest"][n] = {"dropped": sorted(dropped),
                                  "agreement": round(agreement([i for i in range(n_layers) if i not in dropped]), 4)}
print(json.dumps(report, indent=1))
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)
