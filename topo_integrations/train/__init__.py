"""The pretraining entry points behind scripts/pretrain_gpt_*.sh (docs/pretraining.md): a small GPT,
its data, checkpoints and metrics, trained through DeepSpeed or Megatron with topo-align.
"""
