"""Deep Ensemble: M members, each with its own full backbone weights and head.

Fine-tuned (``finetune: true``, the honest, expensive baseline): M copies of the pretrained
encoder, all trainable, no weight shared. Linear-probed (``finetune: false``): the frozen
copies would be identical, so ONE frozen encoder is kept and its features feed M heads (the
parameter counts report exactly that).

What makes the members differ. M independent runs would differ by their head's random init,
their own dropout masks and their own data order. Trained together, the members see the same
mini-batches (each still draws its own dropout masks and, normally, its own random head), so
the head init carries the diversity (``data_order: shared``, the default). With
``data_order: independent`` every member draws its own data order as M independent runs would:
the trainer reads M independently shuffled loaders (``data_streams()``), member m's copy is
trained on stream m's batch (M·B rows, member-major) and the loss is the mean of the members'
own cross-entropies; evaluation gives every member the same inputs. Heads that start from a
causal LM's answer rows (ARC-Easy as next-token scoring) are not random: there every member
would be an exact copy of every other for the whole run. So those heads are perturbed per
member as SVE perturbs the pretrained spectrum, W_m = rows ⊙ (1 + σ·ε_m), b_m = σ·N(0, I)
with σ = ``sigma_init`` (0 = exact copies, only when asked for). (Permuting the rows inside one
shared batch would change nothing: the mean loss and its gradient are the same; independent
order needs a batch per member.)

``vectorize: true`` runs the M fine-tuned copies as one vmapped call (torch.func:
stack_module_state + functional_call + vmap) over stacked weights (M, …) instead of a Python
loop: the same numbers, fewer kernel launches on a GPU. Each member still owns its weights.

One member per job (``member: k``, the way a 7B ensemble is run: one GPU or node per member).
The job builds and trains member k of the M-member ensemble ALONE, exactly as it would train
inside the one-process ensemble, and ``uqbench-combine`` scores the saved member predictions
as the ensemble afterwards (``uqbench/runner/jobs/combine.py``). Two things make that exact:

- initialisation: the job draws the whole ensemble's head initialisation (M sets, from the
  same generator state, so the random numbers drawn after it are the same too) and keeps set
  k; the encoder is built from the same seed, as every copy is;
- the loss: the one-process loss is (1/M) Σ_m CE_m, so member k's gradient there is
  ∇CE_k / M. The member job minimises CE_k / M, its share, so its gradient, its per-member
  clipping and AdamW's ε act on the same numbers (training on CE_k alone would clip at a
  threshold M times lower and change the ε term).

What still differs: random numbers drawn during training (dropout masks, and the batch order
of later epochs, which the global generator also draws) come from one stream in the
one-process run and from one stream per job here; and ``trainer.select=best`` picks each
member's own best validation epoch instead of the ensemble's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from uqbench.backbones.base import Backbone, stem_parameters
from uqbench.contracts import Batch, DataInfo, one_of, split_rows
from uqbench.methods.base import MemberParameters
from uqbench.methods.ensemble import (
    DataOrder,
    EnsembleMethod,
    Inputs,
    check_members,
    check_sigma,
)


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter and buffer names cannot contain dots


def check_member(member: Any, members: Any) -> int | None:
    """``member`` as an int in [0, members), None for the whole ensemble in one job, or a
    ValueError naming the value and the valid range."""
    if member is None:
        return None
    members = check_members(members)
    ok = isinstance(member, int) and not isinstance(member, bool)
    if not ok or not 0 <= member < members:
        raise ValueError(
            f"method.member={member!r} is not a member of an ensemble of method.members="
            f"{members}: give an integer from 0 to {members - 1} (one job per member), or "
            f"null to train all {members} members in one job")
    return member


class DeepEnsemble(EnsembleMethod):
    """M independent (encoder copy, head) pairs; logits (M, B, C), member m from copy m.

    Parameters of the copies are named ``de_encoders.<m>.…`` (or, vectorised,
    ``de_params.<name with __ for .>`` of shape (M, …)), the heads ``head.…``. Fine-tuned, it
    trains the copies and the heads; linear-probed, the heads only. sigma_init: σ of the
    per-member perturbation of heads started from a causal LM's answer rows (0.01, SVE's
    σ_init; 0 = exact copies); random heads differ anyway and are left as drawn.
    member: None (all M members, here) or k: only member k of the M-member ensemble, as it
    would be initialised and trained inside it (see the module docstring); logits (1, B, C).
    """

    def __init__(self, backbone: Backbone, info: DataInfo, members: int = 4, finetune: bool = True,
                 vectorize: bool = False, sigma_init: float = 0.01, member: int | None = None,
                 data_order: DataOrder = "shared", name: str = "deep_ensemble") -> None:
        sigma_init = check_sigma(sigma_init)
        self_data_order = one_of("method.data_order", data_order, DataOrder)
        if self_data_order == "independent" and (member is not None or not finetune
                                                 or vectorize):
            raise ValueError("method.data_order=independent trains each fine-tuned encoder copy "
                             "on its own batches in one job: it needs finetune=true, "
                             "vectorize=false and member=null")
        member = check_member(member, members)  # before anything is built
        super().__init__(backbone, info, members, name, head_sigma=sigma_init)
        self.sigma_init = sigma_init
        self.data_order = self_data_order
        self.finetune = bool(finetune)
        self.vectorize = bool(vectorize) and self.finetune
        self.member, self.ensemble_members = member, self.members
        if self.member is not None:
            self._keep_member(self.member)
        if self.finetune:
            self._copy_encoder()
        self.train_declared()

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """Cross-field checks on the config, before anything is read or built."""
        check_member(settings.get("member"), settings.get("members", 4))

    def _keep_member(self, k: int) -> None:
        """Keep head set k of the M drawn (the ensemble's draw, so member k starts as it would
        inside the ensemble); the method then has one member."""
        head = self.head
        with torch.no_grad():
            head.weight = nn.Parameter(head.weight[k:k + 1].clone())             # (1, C, D)
            head.bias = nn.Parameter(head.bias[k:k + 1].clone())                 # (1, C)
        head.sets = 1
        self.members = 1

    def loss(self, batch: Batch) -> torch.Tensor:
        """(1/M) Σ_m CE(logits_m, y); a member job: its share, CE_k / M (module docstring).
        Independent data order: member m's logits against stream m's labels (y (M·B,)), as
        ``EnsembleMethod.loss`` reads its own streams (never in a member job)."""
        return super().loss(batch) / (self.ensemble_members if self.member is not None else 1)

    def _copy_encoder(self) -> None:
        """Replace the one encoder by M copies (a loop over a ModuleList, or stacked weights)."""
        encoder = self.encoder
        del self.encoder
        copies = [encoder] + [copy.deepcopy(encoder) for _ in range(self.members - 1)]
        if not self.vectorize:
            self.de_encoders = nn.ModuleList(copies)
            return
        from torch.func import stack_module_state

        params, buffers = stack_module_state(copies)                             # (M, …) each
        self.de_params = nn.ParameterDict({_key(k): nn.Parameter(v) for k, v in params.items()})
        self._buffer_names = list(buffers)
        for k, v in buffers.items():
            self.register_buffer(f"de_buffer__{_key(k)}", v)
        self._skeleton = [encoder.to("meta")]  # a list: not a submodule, holds no memory

    def fine_tuned(self) -> list[nn.Module]:
        if not self.finetune:
            return []
        return [self.de_params] if self.vectorize else [self.de_encoders]

    def member_parameters(self) -> MemberParameters:
        """The heads (M, …) and, fine-tuned, encoder copy m owned by member m (or, vectorised,
        the stacked copies (M, …))."""
        layout = super().member_parameters()
        if self.members == 1:  # one model (M = 1, or a member job): one group of everything
            return layout
        if self.finetune and self.vectorize:
            layout.stacked += list(self.de_params.values())
            layout.shared = []
        elif self.finetune:
            stem = {id(p) for p in stem_parameters(self)}  # a frozen stem is no member's
            layout.owned = [[p for p in enc.parameters() if id(p) not in stem]
                            for enc in self.de_encoders]
            layout.shared = []
        return layout

    def _stacked_features(self, inputs: Inputs) -> torch.Tensor:
        from torch.func import functional_call

        skeleton = self._skeleton[0].train(self.training)
        params = {k: self.de_params[_key(k)] for k, _ in skeleton.named_parameters()}
        buffers = {k: getattr(self, f"de_buffer__{_key(k)}") for k in self._buffer_names}

        def one(p, b, x):
            return functional_call(skeleton, (p, b), (x,))

        feats = torch.vmap(one, in_dims=(0, 0, None), randomness="different")(
            params, buffers, inputs)                                             # (M, B, D)
        return feats.reshape(-1, feats.shape[-1])

    def features(self, inputs: Inputs) -> torch.Tensor:
        """Member-major features (M·B, D): member m's rows come from encoder copy m."""
        if not self.finetune:
            f = self.encoder(inputs)                                             # (B, D)
            return f.repeat(self.members, 1)
        if self.vectorize:
            return self._stacked_features(inputs)
        if self._own_streams():  # stream m's rows are member m's batch
            chunks = split_rows(inputs, self.members)
            return torch.cat([enc(x) for enc, x in zip(self.de_encoders, chunks, strict=True)])
        return torch.cat([enc(inputs) for enc in self.de_encoders])              # (M·B, D)

    def settings(self) -> dict[str, Any]:
        """members is the ensemble's M, also in a member job (member: k, else None)."""
        return super().settings() | {
            "members": self.ensemble_members, "member": self.member,
            "finetune": self.finetune, "vectorize": self.vectorize, "sigma_init": self.sigma_init,
            "data_order": self.data_order,
            "targets": "full backbone" if self.finetune else "heads only"}

    @classmethod
    def combine_param_counts(cls, counts: list[dict[str, Any]], finetune: bool
                             ) -> dict[str, Any]:
        """The parameter counts of the whole ensemble from those of its M member jobs
        (``param_counts()`` of each): fine-tuned, every member owns an encoder copy and a
        head, so everything adds up; linear-probed, one frozen encoder (and its buffers) is
        shared and only the heads add up."""
        first = counts[0]
        shared = {"total": 0, "param_bytes": 0, "buffer_bytes": 0}
        if not finetune:
            shared = {"total": first["base"], "param_bytes": first["base_bytes"],
                      "buffer_bytes": first["buffer_bytes"]}
        out = {"base": first["base"], "base_bytes": first["base_bytes"]}
        for key in ("total", "param_bytes", "buffer_bytes"):
            out[key] = shared[key] + sum(c[key] - shared[key] for c in counts)
        out["heads"] = sum(c["heads"] for c in counts)
        out["trainable"] = sum(c["trainable"] for c in counts)
        out["added"] = out["total"] - out["base"] - out["heads"]
        out["overhead_pct"] = 100.0 * out["added"] / out["base"]
        out["memory_bytes"] = out["param_bytes"] + out["buffer_bytes"]
        return {k: out[k] for k in first if k in out} | {
            k: v for k, v in out.items() if k not in first}
