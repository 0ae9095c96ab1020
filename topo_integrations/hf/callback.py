"""``TopoAlignCallback``: the plugin's figures in the Trainer's logs, its state beside each checkpoint.

* ``on_log``: adds ``topo_align/method``, ``topo_align/sync_share``,
  ``topo_align/slow_tier_bytes_per_step`` (mean over the optimizer steps since the last log),
  ``topo_align/slow_tier_bytes`` (total), ``topo_align/reconciles`` and ``topo_align/steps`` to the
  logs, so every ``report_to`` integration (TensorBoard, W&B, ...) and ``state.log_history`` hold
  them. Integrations read the logs in callback order: the callback must come before them, which
  :func:`add_callback` (and ``install()``) arranges.
* ``on_step_end``: when the Trainer will save or evaluate at this step, reconciles first (all ranks,
  `selective`): the checkpoint then holds identical replicas (invariant 4 of docs/design.md).
* ``on_save``: this rank's engine state into ``<checkpoint>/topo_align/rank<N>.pt`` (DDP, FSDP2;
  DeepSpeed writes its own inside ``save_checkpoint``); ``on_train_begin`` loads it back when
  ``train(resume_from_checkpoint=...)`` resumes (the path :func:`add_callback` records).
"""

from __future__ import annotations

import functools
import logging
import os

from transformers import TrainerCallback

from .attach import attached
from .console import say

__all__ = ["TopoAlignCallback", "add_callback"]

log = logging.getLogger("topo_align")


class TopoAlignCallback(TrainerCallback):
    """See the module docstring. ``trainer``: the Trainer it serves (to find the checkpoint a resumed
    ``train()`` loads and the wrapped model); :func:`add_callback` passes it."""

    def __init__(self, trainer=None):
        self.trainer = trainer
        self._last = None
        """(engine steps, slow-tier bytes) at the previous log."""

    def _att(self, model):
        att = attached(model)
        if att is None and self.trainer is not None:
            att = attached(getattr(self.trainer, "model_wrapped", None))
        return att

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        att = self._att(model)
        if att is None:
            return
        resume = getattr(self.trainer, "_topo_align_resume", None)
        if resume and att.saves_beside:
            if att.load(resume):
                say(f"topo-align: engine state restored from {os.path.join(resume, 'topo_align')} "
                    f"(step {att.engine.step})")
            else:
                say(f"topo-align: {resume} holds no engine state (saved without topo-align?); the engine "
                    "starts afresh (error-feedback residuals, classes, reconciliation anchors)", warning=True)
        f = att.figures()
        self._last = (f["topo_align/steps"], f["topo_align/slow_tier_bytes"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if control.should_save or control.should_evaluate:
            att = self._att(model)
            if att is not None:
                att.reconcile()

    def on_save(self, args, state, control, model=None, **kwargs):
        att = self._att(model)
        if att is not None and att.saves_beside:
            att.save(self._checkpoint_dir(args, state))

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        att = self._att(model)
        if att is None or logs is None:
            return
        f = att.figures()
        steps, slow = f["topo_align/steps"], f["topo_align/slow_tier_bytes"]
        s0, b0 = self._last or (0, 0)
        f["topo_align/slow_tier_bytes_per_step"] = (slow - b0) / (steps - s0) if steps > s0 else 0.0
        self._last = (steps, slow)
        logs.update(f)
        hist = state.log_history
        if hist and hist[-1].get("step") == state.global_step:
            hist[-1].update(f)  # the Trainer appended a copy of these logs before calling on_log

    def _checkpoint_dir(self, args, state) -> str:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = args.output_dir
        if self.trainer is not None and hasattr(self.trainer, "_get_output_dir"):
            run_dir = self.trainer._get_output_dir(trial=None)
        return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def add_callback(trainer) -> TopoAlignCallback:
    """Add a :class:`TopoAlignCallback` to ``trainer`` where it must be: after the flow callback
    (which decides ``should_save``) and before the reporting integrations (which read the logs);
    record the checkpoint ``trainer.train(resume_from_checkpoint=...)`` resumes from. Idempotent."""
    from transformers.trainer_callback import DefaultFlowCallback

    cbs = trainer.callback_handler.callbacks
    for cb in cbs:
        if isinstance(cb, TopoAlignCallback):
            return cb
    cb = TopoAlignCallback(trainer)
    flow = [i for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)]
    cbs.insert(flow[-1] + 1 if flow else 0, cb)
    if not getattr(trainer.train, "_topo_align", False):
        trainer.train = _recording_train(trainer, trainer.train)
    return cb


def resume_path(trainer, resume_from_checkpoint):
    """The checkpoint folder a ``train(resume_from_checkpoint=...)`` call resumes from, or None."""
    if isinstance(resume_from_checkpoint, bool):
        if not resume_from_checkpoint:
            return None
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(trainer.args.output_dir)
    return resume_from_checkpoint


def _recording_train(trainer, train):
    @functools.wraps(train)
    def wrapped(resume_from_checkpoint=None, *args, **kwargs):
        trainer._topo_align_resume = resume_path(trainer, resume_from_checkpoint)
        return train(resume_from_checkpoint, *args, **kwargs)

    wrapped._topo_align = True
    return wrapped
