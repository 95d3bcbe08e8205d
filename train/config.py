"""The typed training configuration (frozen: a run is a pure function of it and its data)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from tev_jax.exit_train import check_prefix_window, check_score_capacities
from tev_jax.exit_weights import NORMALIZERS, WEIGHTINGS, check_floor
from tev_jax.sampling import Sampling
from tev_jax.sharding import TARGET_SHARDINGS
from train.step import DTYPES, REMAT
from train.storage import require_local

LOSSES = ("token",) + WEIGHTINGS

# Named presets of TrainConfig fields (``--recipe NAME``; --config and flags override).
# 'paper': the authors' released ExitTrain recipe (hsj576/TEV, SpecForge, Qwen3-4B
# config): 1.0 * CE + 0.1 * exit term, the exit term's weighted NLL divided by the number
# of tree nodes, reach weights P with target edge probabilities floored at 1e-4 (their
# 'P_tgt'), DDTree budget 32, 32 anchors, batch 4, lr 1e-4, clipping at 1, and their
# scoring pass that sees only the 64 tokens before each anchor (exit_prefix_window), and
# their token loss over anchors whose horizon runs past the response end (partial_anchors).
# Not carried over: their 2 epochs (set --steps for your data) and warmup ratio 0.005.
# 'opd': the Draft-OPD authors' trainer (bingyang-lei/Draft-OPD, verl, their Qwen3-4B
# GSM8K script): rollouts decoded greedily (T 0) by the DFlash drafter it fine-tunes, the
# target's log-probabilities at T 1, lr 1e-5 (cosine), a fresh rollout for every update
# (opd_steps 1) of 24 prompts, and the paper's loss weights (`tev_jax.draft_opd.OpdConfig`:
# w_R = w_J = 1, decay 0.8, floor -10, cap 10; their GSM8K script raises w_J to 2 and the
# decay to 0.9). Not carried over: their 4096-token responses (opd_max_new_tokens 256),
# their every-round anchors (we draw num_anchors rounds per sequence), their 10 rollout
# batches accumulated per update (set --grad-accum) and warmup ratio 0.05.
RECIPES: dict[str, dict[str, Any]] = {
    "paper": dict(loss="reach", exit_lambda=0.1, exit_normalizer="nodes", exit_floor=1e-4,
                  budget=32, num_anchors=32, batch_size=4, lr=1e-4, grad_clip=1.0,
                  temperature=1.0, top_k=None, top_p=None, exit_prefix_window=64,
                  partial_anchors=True),
    "opd": dict(objective="opd", lr=1e-5, grad_clip=1.0, opd_steps=1, opd_prompts=24,
                opd_temperature=0.0, opd_response_weight=1.0, opd_rejected_weight=1.0,
                opd_decay=0.8, opd_logp_floor=-10.0, opd_cap=10.0),
}

OBJECTIVES = ("token", "exittrain", "opd")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Drafter training with the DFlash token objective and ExitTrain (docs/design.md §8).

    Models:
      target_path: Hugging Face directory of the frozen target.
      drafter_path: DFlash drafter directory to fine-tune; None initialises a new one
        with the next four fields.
      drafter_layers: a new drafter's Qwen3 layers.
      block_size: a new drafter's block (its draft horizon H = block_size - 1).
      mask_token_id: a new drafter's mask token (default: the id of ``<|mask|>`` in the
        target's tokenizer).
      target_layer_ids: the target layers a new drafter reads (comma-separated;
        default: the DFlash spacing).
      target_dtype: parameter and activation dtype of the frozen target: 'float32',
        'bfloat16' or 'auto' (bfloat16 on accelerators, float32 on CPU, where XLA
        computes bfloat16 slowly through float32 copies). bfloat16 halves the target's
        memory; its logits and every loss stay float32.
      param_dtype: the drafter's trained parameters and optimiser state (master
        weights; float32 unless memory forces otherwise).
      compute_dtype: the dtype the drafter's parameters are cast to for its forward
        ('auto': as target_dtype).
      attention_window: the target's sliding layers 'native' (as trained) or 'full'
        (every layer global, as the DFlash authors ran Gemma 4).

    Data:
      data_dir: target rollouts written by ``python -m train rollouts``.
      batch_size: B sequences per micro-batch (global, over all devices).
      num_anchors: A anchors per sequence.
      partial_anchors: also draw anchors whose H labels run past the response end: the
        token loss counts their labels inside the response, the tree term (and τ) only
        full-horizon anchors (the authors' trainer; `train.anchors`). Default false:
        every anchor has all H labels.

    Objective:
      objective: 'token' (the DFlash token loss on the rollouts), 'exittrain' (token
        loss + the ExitTrain tree term) or 'opd' (Draft-OPD: on-policy distillation on
        the drafter's own speculative rounds, `train.opd_phases`).
      loss: ExitTrain's node weighting: 'exit' (weight w), 'exit_depth' (w * depth),
        'prefix' (P) or 'reach' (P with the floor; see
        `tev_jax.exit_weights.node_weights`). 'token' is the older spelling of
        objective 'token' (read as such).
      budget: DDTree node budget of the training trees (N = budget + 1), and of an opd
        run's rollout trees.
      exit_lambda: total = token + exit_lambda * exit.
      exit_normalizer: 'weight' (exit term = weighted NLL / total weight) or 'nodes'
        (/ number of tree nodes, the authors' release).
      exit_floor: target edge probabilities floored at this alpha inside the reach of
        the node weights (0: exact; the authors use 1e-4).
      temperature, top_k, top_p: the target's sampling transform for the exit law.
      token_decay_gamma: optional DFlash position decay of the token loss.
      opd_steps: opd: updates per rollout phase (the rollouts are refreshed by the
        current drafter after this many updates; 1: every update, the authors').
      opd_prompts: opd: training prompts decoded per rollout phase.
      opd_rollout_batch: opd: prompts decoded together in a rollout phase.
      opd_max_new_tokens: opd: response length cap of the rollouts.
      opd_builder: opd: the rollouts' tree builder ('ddtree', 'chain', ...).
      opd_verifier: opd: the rollouts' verifier ('tev', 'predraw', 'greedy', ...).
      opd_temperature: opd: the rollouts' decode temperature (the authors' 0).
      opd_response_weight, opd_rejected_weight, opd_decay, opd_logp_floor, opd_cap: opd:
        `tev_jax.draft_opd.OpdConfig` (w_R, w_J, offset decay, log-probability floor,
        per-token cap).
      tree_metrics: with objective 'token', still build and score the trees to log the
        drafter's expected block length (the exit branch then costs the same as for
        ExitTrain but carries no gradient).

    Optimiser (optax AdamW with linear warmup and cosine decay):
      steps: optimiser updates of the run (they shape the learning-rate schedule).
      lr: the peak learning rate.
      warmup_steps: linear warmup from 0 over this many updates (the command line's
        default is 10, or the whole run when it is shorter).
      end_lr_ratio: the cosine decays to lr * end_lr_ratio.
      weight_decay: AdamW decay of the matrices.
      b1, b2: Adam's decay rates of the first and second moments.
      grad_clip: the gradient's global norm is clipped to this.
      grad_accum: micro-batches per update (``optax.MultiSteps``).

    Devices:
      mesh_data, mesh_fsdp, mesh_tensor: mesh axis sizes (product <= devices). The
        drafter and its optimiser state are sharded over fsdp, the batch over data and
        fsdp.
      target_sharding: 'fsdp' (default: the frozen target's parameters are split over
        fsdp and tensor like the drafter's and gathered layer by layer; a Qwen3-4B
        target costs 15 GiB per device replicated in float32, 1.9 GiB on fsdp 8) or
        'replicated' (copies on every data / fsdp device, split over tensor only:
        no weight all-gathers, for targets that fit).
      remat: 'none', 'full' or 'dots': rematerialise each drafter layer in the
        backward pass (`train.step.REMAT`).
      exit_prefix_window: None (default): the trees are scored with each anchor's whole
        prefix; W: with only the W tokens before the anchor, re-encoded on their own
        (the authors' trainer, W = 64; `tev_jax.tree_scoring.score_window_hidden`).
      score_capacities: leaf-skipping scoring pass
        (`tev_jax.exit_train.ExitTrainConfig`); empty: score every tree node.
      distributed: call ``jax.distributed.initialize()`` first (multi-host).

    Run:
      out_dir: checkpoints (``out_dir/checkpoints``), ``train_log.jsonl`` and the final
        drafter (``out_dir/drafter``); a local folder (process 0 writes the log).
      checkpoint_dir: where checkpoints go instead of ``out_dir/checkpoints``; may be a
        bucket (``gs://...``) that every process of a pod writes its shards to.
      checkpoint_every: an orbax checkpoint every this many updates (and at the last).
      keep_checkpoints: how many of the newest checkpoints are kept; older ones are
        deleted as new ones are written.
      drafter_every: also write the drafter (DFlash layout) to
        ``out_dir/drafters/update-<k>`` every this many updates: snapshots along one run
        (e.g. drafters of increasing strength); 0 (default): only the final one.
      log_every: metrics are fetched and logged every this many updates.
      seed: the batch at update k is a pure function of (seed, k).
      resume: None (default) continues from the newest checkpoint that restores (an
        unreadable newer one is moved aside) and starts a new run, saying so, where
        there is none; true continues and refuses a folder without a checkpoint (a
        mistyped out_dir); false starts over, moving an earlier run's checkpoints aside
        to ``<checkpoints>.replaced-<time>``.
    """

    target_path: str | None = None
    drafter_path: str | None = None
    drafter_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    target_dtype: str = "auto"
    param_dtype: str = "float32"
    compute_dtype: str = "auto"
    attention_window: str = "native"

    data_dir: str | None = None
    batch_size: int = 4
    num_anchors: int = 32
    partial_anchors: bool = False

    objective: str = "exittrain"
    loss: str = "exit"
    budget: int = 32
    exit_lambda: float = 0.1
    exit_normalizer: str = "weight"
    exit_floor: float = 0.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    token_decay_gamma: float | None = None
    tree_metrics: bool = False
    exit_prefix_window: int | None = None
    score_capacities: tuple[float, ...] = ()
    opd_steps: int = 1
    opd_prompts: int = 24
    opd_rollout_batch: int = 8
    opd_max_new_tokens: int = 256
    opd_builder: str = "ddtree"
    opd_verifier: str = "tev"
    opd_temperature: float = 0.0
    opd_response_weight: float = 1.0
    opd_rejected_weight: float = 1.0
    opd_decay: float = 0.8
    opd_logp_floor: float = -10.0
    opd_cap: float = 10.0

    steps: int = 1000
    lr: float = 1e-4
    warmup_steps: int = 10
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1

    mesh_data: int = 1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    target_sharding: str = "fsdp"
    remat: str = "none"
    distributed: bool = False

    out_dir: str = "runs/train"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    drafter_every: int = 0
    log_every: int = 1
    seed: int = 0
    resume: bool | None = None

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.loss == "token":   # the older spelling of objective='token'
            if self.objective == "opd":
                raise ValueError("loss='token' means objective='token'; an opd run takes "
                                 "no loss (drop --loss token)")
            object.__setattr__(self, "objective", "token")
            object.__setattr__(self, "loss", TrainConfig.loss)
        if self.loss not in WEIGHTINGS:
            raise ValueError(f"loss must be one of {WEIGHTINGS} (ExitTrain's node "
                             f"weighting) or 'token' (objective 'token'), got {self.loss!r}")
        for name, allowed in (("target_dtype", DTYPES + ("auto",)), ("param_dtype", DTYPES),
                              ("compute_dtype", DTYPES + ("auto",)),
                              ("attention_window", ("native", "full")),
                              ("target_sharding", TARGET_SHARDINGS), ("remat", tuple(REMAT))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        check_score_capacities(self.score_capacities)
        check_prefix_window(self.exit_prefix_window)
        if self.exit_prefix_window is not None and self.score_capacities:
            raise ValueError("exit_prefix_window and score_capacities cannot be combined")
        self.opd_config  # validates the opd weights
        for name in ("opd_temperature",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        positive = ("opd_steps", "opd_prompts", "opd_rollout_batch", "opd_max_new_tokens",
                    "drafter_layers", "batch_size", "num_anchors", "budget", "steps",
                    "grad_accum", "mesh_data", "mesh_fsdp", "mesh_tensor",
                    "checkpoint_every", "keep_checkpoints", "log_every")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.drafter_every, int) or self.drafter_every < 0:
            raise ValueError(f"drafter_every must be an int >= 0, got {self.drafter_every!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], "
                             f"got {self.warmup_steps}")
        for name, ok, rule in (
                ("lr", lambda v: v > 0, "> 0"), ("end_lr_ratio", lambda v: 0 <= v <= 1,
                                                  "in [0, 1]"),
                ("exit_lambda", lambda v: v >= 0, ">= 0"),
                ("weight_decay", lambda v: v >= 0, ">= 0"),
                ("b1", lambda v: 0 <= v < 1, "in [0, 1)"), ("b2", lambda v: 0 <= v < 1,
                                                            "in [0, 1)"),
                ("grad_clip", lambda v: v > 0, "> 0")):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or not ok(v)):
                raise ValueError(f"{name} must be a finite number {rule}, got {v!r}")
        if self.exit_normalizer not in NORMALIZERS:
            raise ValueError(f"exit_normalizer must be one of {NORMALIZERS}, got "
                             f"{self.exit_normalizer!r}")
        check_floor(self.exit_floor)
        if self.token_decay_gamma is not None and not 0 < self.token_decay_gamma < math.inf:
            raise ValueError(f"token_decay_gamma must be a finite number > 0, got "
                             f"{self.token_decay_gamma}")
        if self.target_layer_ids is not None and not isinstance(self.target_layer_ids, tuple):
            raise ValueError("target_layer_ids must be a tuple of ints or None")
        self.sampling  # validates temperature / top-k / top-p
        check_local_folders(self)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)

    @property
    def dtypes(self) -> tuple[str, str, str]:
        """(target, param, compute) dtypes with 'auto' resolved for the default backend."""
        import jax

        auto = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        target = auto if self.target_dtype == "auto" else self.target_dtype
        compute = target if self.compute_dtype == "auto" else self.compute_dtype
        return target, self.param_dtype, compute

    @property
    def opd_config(self):
        """The `tev_jax.draft_opd.OpdConfig` of the opd_* weights."""
        from tev_jax.draft_opd import OpdConfig

        return OpdConfig(response_weight=self.opd_response_weight,
                         rejected_weight=self.opd_rejected_weight, decay=self.opd_decay,
                         logp_floor=self.opd_logp_floor, cap=self.opd_cap)

    @property
    def exittrain_loss(self) -> str:
        """`tev_jax.exit_train.ExitTrainConfig.loss` of a token / ExitTrain run."""
        return "token" if self.objective == "token" else self.loss

    @property
    def builds_trees(self) -> bool:
        """Whether a step builds and scores draft trees (a token or ExitTrain step)."""
        return self.objective == "exittrain" or (self.objective == "token"
                                                 and self.tree_metrics)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.mesh_data, self.mesh_fsdp, self.mesh_tensor)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["target_layer_ids"] is not None:
            d["target_layer_ids"] = list(d["target_layer_ids"])
        d["score_capacities"] = list(d["score_capacities"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        if "dtype" in d:    # configs written before target / param / compute dtypes
            legacy = d.pop("dtype")
            for name in ("target_dtype", "param_dtype", "compute_dtype"):
                d.setdefault(name, legacy)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown training config fields: {unknown}")
        if d.get("target_layer_ids") is not None:
            d["target_layer_ids"] = tuple(int(i) for i in d["target_layer_ids"])
        if d.get("score_capacities") is not None:
            d["score_capacities"] = tuple(float(c) for c in d["score_capacities"])
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "TrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def run_fingerprint(self) -> dict[str, Any]:
        """The fields a resumed run must share with the run that wrote the checkpoint.

        ``steps`` is included because it shapes the learning-rate schedule; the
        checkpoint/logging cadence and ``resume`` are not.
        """
        skip = {"checkpoint_every", "keep_checkpoints", "log_every", "resume", "out_dir",
                "checkpoint_dir", "distributed"}
        if self.objective != "opd":   # as checkpoints written before the opd fields
            skip |= {"objective"} | {f.name for f in dataclasses.fields(self)
                                     if f.name.startswith("opd_")}
        d = {k: v for k, v in self.to_dict().items() if k not in skip}
        if self.objective == "token":
            d["loss"] = "token"       # the older spelling's record
        return d


def check_local_folders(cfg: TrainConfig) -> None:
    """Refuses a remote (``gs://``) folder where a run needs a local or mounted one, in
    one line naming what to do instead; only ``checkpoint_dir`` may be a bucket
    (`train.storage`)."""
    copy = ("copy it to local disk (gcloud storage cp -r) or mount the bucket with "
            "gcsfuse, and pass that folder")
    require_local(cfg.data_dir, "data_dir", "rollouts are memory-mapped and read a few "
                  f"rows at every update; {copy}")
    require_local(cfg.target_path, "target_path", copy)
    require_local(cfg.drafter_path, "drafter_path", copy)
    require_local(cfg.out_dir, "out_dir", "it holds the run's lock, its log (appended "
                  "at every update) and the drafter; keep it local, put the checkpoints "
                  "in the bucket with --checkpoint-dir gs://..., and copy the drafter "
                  "there after the run (gcloud storage cp -r OUT_DIR/drafter gs://...)")


def field_help() -> dict[str, str]:
    """Each `TrainConfig` field's line of its docstring (``name: text`` entries, a
    shared entry ``a, b: text`` for each name), as plain text: the ``tev-train run``
    help."""
    helps: dict[str, str] = {}
    names, text = None, []

    def flush():
        if names:
            plain = re.sub(r"`+([^`]+)`+", r"\1", " ".join(text))
            helps.update({n: plain for n in names})

    for line in (TrainConfig.__doc__ or "").splitlines():
        entry = re.fullmatch(r" {6}([a-z_0-9]+(?:, [a-z_0-9]+)*): (.*)", line)
        if entry:
            flush()
            names, text = entry.group(1).split(", "), [entry.group(2).strip()]
        elif names and re.fullmatch(r" {8}\S.*", line):
            text.append(line.strip())
        else:
            flush()
            names, text = None, []
    flush()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in helps.items() if k in fields}


__all__ = ["LOSSES", "OBJECTIVES", "RECIPES", "TrainConfig", "check_local_folders",
           "field_help"]
