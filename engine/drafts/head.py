"""Feature-conditioned draft head (EAGLE-style; docs/specbranch.md (Feature-conditioned drafts)).

The draft is not a small LM. It reads what the target already computed:

    row r:  input  = fc([embed(x_r) ; f_{r-1}])         f_{r-1}: the target's last hidden state (post-norm)
                                                         at position r-1, or the head's own prediction
                                                         of it where the target has not seen r-1 yet
            hidden = norm(decoder_layer(input))          the predicted f_r                  [B, T, H]
            logits = hidden @ lm_head[subset].T          the draft's q for x_{r+1}  (-inf outside the subset)

Row 0 has no previous feature (zeros), so row r consumes token x_r and predicts x_{r+1}, exactly as a
standalone LM does: the engine feeds the head tokens, and the cache remembers which features go with them.

A fused head (EAGLE-3) reads several of the target's layers instead of its last state alone: `feature_layers`
names them as indices into the target's hidden states (0: the embeddings, i: layer i's output, L: the final-norm
state), e.g. low, mid and high (2, 15, 27) of 30 layers. The target's forward then hands over [T, k H], and

    f_{r-1} = fuse([norm_1(h_a) ; ... ; norm_k(h_c)])    at positions the target computed  (k H -> H)

while beyond them the head's own output stands in for f_{r-1}, as for a last-state head. A head without the entry
reads the final-norm state (L,) alone and has no fuse.

`HeadCache` holds the layer's KV cache and two feature tables, both indexed by position:
  true_feats  what the target computed at committed positions (the engine pushes them after each verdict)
  pred        what the head predicted at each of its rows, per batch row (branches differ)
Rollback is a length pointer over both. `stale_from` says where rows were built on a prediction that a
true feature has since replaced, so the engine can re-feed them (EAGLE re-drafts from the verified prefix).

On disk (`save_head`): config.json (the target's config with 1..n layers, plus a "specbranch_head" entry naming
the feature layers), model-NN.safetensors (fuse, fc, layers, norm; int8 matrices, drafts/storage.py),
vocab_subset.safetensors. The embeddings and the LM head rows are borrowed from the target at load time.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.config import SpecBranchError
from engine.drafts.storage import load_vocab_subset, load_weights, save_vocab_subset, save_weights
from engine.kernels.lm_head import draft_matmul, fast_linears
from engine.models.devices import cast_model

HEAD_KEY = "specbranch_head"


def head_config(target_config, n_layers: int):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


class FeatureHead(torch.nn.Module):
    """fc(2H -> H) + n decoder layers of the target's own class + the target's final norm (trainable copy)."""

    def __init__(self, config, layer_cls, rotary_cls, norm_cls, feature_layers: tuple[int, ...] | None = None):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.feature_layers = tuple(feature_layers) if feature_layers else None  # None: the final-norm state alone
        if self.feature_layers:  # fused: each layer's state normalised (their scales differ), then k H -> H
            self.fuse_norms = torch.nn.ModuleList([norm_cls(h, eps=config.rms_norm_eps) for _ in self.feature_layers])
            self.fuse = torch.nn.Linear(len(self.feature_layers) * h, h, bias=False)
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.layers = torch.nn.ModuleList([layer_cls(config, i) for i in range(config.num_hidden_layers)])
        self.norm = norm_cls(h, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_cls(config=config)

    def fused(self, raw: torch.Tensor) -> torch.Tensor:
        """The target's features as the head reads them: raw [..., k H] (the feature layers side by side) ->
        [..., H]; a last-state head reads them as they are."""
        if not self.feature_layers:
            return raw
        parts = raw.split(self.config.hidden_size, dim=-1)
        return self.fuse(torch.cat([norm(x) for norm, x in zip(self.fuse_norms, parts)], dim=-1))

    @classmethod
    def from_target(
        cls, target, n_layers: int = 1, init_from_last: bool = True, feature_layers: tuple[int, ...] | None = None
    ) -> FeatureHead:
        """A head for `target` (a transformers CausalLM); its layers start as copies of the target's last ones
        (they already map a late residual stream to the next feature), its fc as [0 ; I] (pass f through). A fused
        head's fuse starts as the mean of its normalised layers."""
        inner = target.model
        config = head_config(target.config, n_layers)
        head = cls(config, type(inner.layers[-1]), type(inner.rotary_emb), type(inner.norm), feature_layers)
        cast_model(head, dtype=next(target.parameters()).dtype)  # its rotary table stays float32
        if init_from_last:
            for mine, theirs in zip(head.layers, inner.layers[-n_layers:]):
                mine.load_state_dict(theirs.state_dict())
            head.norm.load_state_dict(inner.norm.state_dict())
            with torch.no_grad():
                h = config.hidden_size
                head.fc.weight.zero_()
                head.fc.bias.zero_()
                head.fc.weight[:, h:] = torch.eye(h)
                head.fc.weight[:, :h] = 0.1 * torch.eye(h)
                if head.feature_layers:
                    k = len(head.feature_layers)
                    head.fuse.weight.copy_(torch.eye(h).repeat(1, k) / k)
        return head

    def forward(
        self,
        embeds: torch.Tensor,
        feats: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """embeds, feats [B, T, H]; position_ids [1, T]; mask: bool [B or 1, 1, T, past + T] (True = attend)
        or None for a single row; returns the predicted features [B, T, H] (post-norm)."""
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        pos = self.rotary_emb(x, position_ids=position_ids)
        for layer in self.layers:
            x = layer(
                x,
                attention_mask=mask,
                position_embeddings=pos,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
            )
            x = x[0] if isinstance(x, tuple) else x
        return self.norm(x)


def causal_mask(t: int, past: int, device) -> torch.Tensor:
    """bool [1, 1, t, past + t]: row i sees every cached position and the new rows up to itself."""
    k = torch.arange(past + t, device=device)
    q = torch.arange(t, device=device)[:, None] + past
    return (k[None, :] <= q)[None, None]


class HeadCache:
    """The head's KV cache plus the features that go with each position. Looks like a transformers cache
    to engine.models.cache (get_seq_length, crop, batch_repeat_interleave, batch_select_indices)."""

    def __init__(self, config, capacity: int, device, dtype, fuse=None):
        self.kv = DynamicCache(config=config)
        h = config.hidden_size
        self.fuse = fuse  # the head's FeatureHead.fused: the target's raw features [n, k H] -> [n, H]
        self.true_feats = torch.zeros(capacity, h, device=device, dtype=dtype)  # fused, where the head fuses
        self.n_true = 0  # positions [0, n_true) hold the target's own features
        self.pred = torch.zeros(1, capacity, h, device=device, dtype=dtype)  # the head's output per row
        self.built_on_pred: list[bool] = []  # per row r: was its input f_{r-1} a prediction?
        self.length = 0

    # -- what the engine tells it
    def set_target_features(self, start: int, feats: torch.Tensor) -> None:
        """The target's post-norm features for positions [start, start + len(feats)), committed ones only.
        A gap (start > n_true) is refused: features must arrive in order."""
        if start > self.n_true:
            raise ValueError(f"target features must arrive in order: have {self.n_true}, got a start of {start}")
        end = start + feats.shape[0]
        feats = feats.to(self.true_feats.dtype)
        if self.fuse is not None:
            with torch.inference_mode():
                feats = self.fuse(feats)
        self.true_feats[start:end] = feats
        self.n_true = max(self.n_true, end)

    def stale_from(self) -> int:
        """The first row built on a predicted feature that the target has since computed (or the length)."""
        for r in range(1, min(self.length, self.n_true + 1)):
            if self.built_on_pred[r]:
                return r
        return self.length

    # -- the transformers-cache surface engine.models.cache and the parallel loop use
    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        keep = self.length + n if n < 0 else n
        if keep < self.length:
            self.kv.crop(keep - self.length)  # transformers 5 crops by a negative count
        self.length = keep
        del self.built_on_pred[keep:]

    def batch_repeat_interleave(self, k: int) -> None:
        self.kv.batch_repeat_interleave(k)
        pred = self.pred.new_empty(self.pred.shape[0] * k, *self.pred.shape[1:])  # copy the used rows only
        pred[:, : self.length] = self.pred[:, : self.length].repeat_interleave(k, dim=0)
        self.pred = pred

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        self.kv.batch_select_indices(idx)
        self.pred = self.pred[idx.to(self.pred.device)]

    # -- inputs
    def input_features(self, start: int, n: int) -> torch.Tensor:
        """f_{r-1} for rows r in [start, start + n): true where known, else predicted; [B, n, H]."""
        b, h = self.pred.shape[0], self.pred.shape[-1]
        out = self.pred.new_zeros(b, n, h)  # row 0 reads zeros
        lo, hi = max(start, 1), min(start + n, self.n_true + 1)  # rows whose f_{r-1} the target computed
        if hi > lo:
            out[:, lo - start : hi - start] = self.true_feats[lo - 1 : hi - 1]
        for r in range(max(lo, hi), start + n):  # the rest read the head's own prediction
            out[:, r - start] = self.pred[:, r - 1]
        return out

    def known_run(self, start: int, n: int) -> int:
        """How many of the rows [start, start + n) can be computed in one batched pass: each row's input
        feature must be a true one, except the first, whose predicted input already exists."""
        run = 1
        while run < n and start + run - 1 < self.n_true:
            run += 1
        return run


class HeadLM:
    """A head as the decoders see a draft: forward(input_ids, cache) -> logits [B, T, V] (float32)."""

    reads_target_features = True
    lean = False  # the head has a forward of its own (engine/models/lean.py is for standalone Llama drafts)
    compile_why = ""  # never compiled, so never eager against a request (models.LM.compile_why)

    def __init__(
        self, name: str, head: FeatureHead, target_lm, head_ids: torch.Tensor, tokenizer, matmul: str = "float32"
    ):
        self.name, self.model, self.tokenizer, self.matmul = name, head, tokenizer, matmul
        self.target = target_lm  # borrow embeddings and LM-head rows; never run
        self.vocab_size = target_lm.vocab_size
        self.head_ids = head_ids
        weight = target_lm.model.get_output_embeddings().weight
        if matmul != "float32":  # its decoder layers' linears too (a frozen head: the copies never go stale)
            fast_linears(head, matmul)
        self._head = draft_matmul(matmul, weight[head_ids].to(self.device, self.dtype), head=True)
        self._embed = target_lm.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def compile_status(self) -> tuple[str, str]:
        """(state, why) as models.LM.compile_status has it: always "off", a head's steps are not compiled."""
        return "off", ""

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """Which of the target's hidden states the head reads, side by side (None: the final-norm state)."""
        return self.model.feature_layers

    def new_cache(self) -> HeadCache:
        fuse = self.model.fused if self.model.feature_layers else None
        return HeadCache(self.model.config, self.context_length + 1, self.device, self.dtype, fuse)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HeadCache,
        hidden_states: bool = False,
        features: bool = False,
        last_only: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T]; appends T rows to the cache. Rows whose input features are all known run in one
        pass; a row that needs the previous row's prediction waits for it (drafting beyond the target).
        last_only: the logits of the last row only, [B, 1, V] (the LM head runs on it alone; models.LM.forward)."""
        input_ids = input_ids.to(self.device, non_blocking=True)  # from pinned memory on CUDA (Worker.run)
        b, t = input_ids.shape
        outs, done = [], 0
        while done < t:
            start = cache.length
            n = cache.known_run(start, t - done)
            if cache.pred.shape[0] != b:  # a batch of branches fed before the cache was repeated
                raise ValueError(f"head cache holds {cache.pred.shape[0]} rows, fed {b}")
            embeds = self._embed(input_ids[:, done : done + n]).to(self.dtype)
            feats = cache.input_features(start, n)
            mask = causal_mask(n, start, self.device) if n > 1 else None
            position_ids = torch.arange(start, start + n, device=self.device)[None]
            hidden = self.model(embeds, feats, position_ids, mask, cache.kv)  # [B, n, H]
            cache.pred[:, start : start + n] = hidden
            cache.built_on_pred += [r > 0 and r - 1 >= cache.n_true for r in range(start, start + n)]
            cache.length = start + n
            outs.append(hidden)
            done += n
        hidden = torch.cat(outs, dim=1)
        if last_only:
            hidden = hidden[:, -1:]
        sub = self._head(hidden).float()  # [B, T, |subset|]
        logits = sub.new_full((*sub.shape[:2], self.vocab_size), float("-inf"))
        logits[..., self.head_ids] = sub
        return logits


# ---------------------------------------------------------------- files
def is_head_dir(path: Path) -> bool:
    config = path / "config.json"
    return config.exists() and HEAD_KEY in json.loads(config.read_text())


def save_head(head: FeatureHead, out: Path, vocab_subset: torch.Tensor, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config[HEAD_KEY] = {
        "hidden_size": head.config.hidden_size,
        "vocab_size": head.config.vocab_size,
        "target_layers": meta.get("target_layers"),
        **meta,
        "feature_layers": list(head.feature_layers) if head.feature_layers else None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_weights({k: v for k, v in head.state_dict().items() if "rotary_emb" not in k}, out)
    save_vocab_subset(vocab_subset, out)


def load_head_dir(path: Path, target_model, dtype: torch.dtype, device) -> tuple[FeatureHead, torch.Tensor]:
    """Load a saved head for `target_model`; refuses, naming the field, a head made for another target."""
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    info = raw.pop(HEAD_KEY)
    tc = target_model.config
    for field, theirs in (
        ("hidden_size", tc.hidden_size),
        ("vocab_size", tc.vocab_size),
        ("target_layers", tc.num_hidden_layers),
    ):
        if info.get(field) is not None and info[field] != theirs:
            raise SpecBranchError(
                f"draft head {path} was trained for another target: its {field} is {info[field]}, "
                f"the target's is {theirs}"
            )
    layers = info.get("feature_layers")
    if layers and not all(isinstance(i, int) and 0 <= i <= tc.num_hidden_layers for i in layers):
        raise SpecBranchError(
            f"draft head {path}: its feature_layers {layers} name hidden states the target does not have "
            f"(0..{tc.num_hidden_layers})"
        )
    config = AutoConfig.for_model(**raw)
    config._attn_implementation = target_model.config._attn_implementation  # as the target's layers run
    inner = target_model.model
    head = FeatureHead(config, type(inner.layers[-1]), type(inner.rotary_emb), type(inner.norm), layers)
    missing, unexpected = head.load_state_dict(load_weights(path, torch.float32), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SpecBranchError(f"draft head {path} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    subset = load_vocab_subset(path)
    if int(subset.max()) >= tc.vocab_size:
        raise SpecBranchError(f"draft head {path}: its vocabulary subset names ids beyond the target's {tc.vocab_size}")
    return cast_model(head, device, dtype).eval(), subset.to(device)
