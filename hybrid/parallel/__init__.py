"""Parallelism's primitives: the sizes, the groups, the collectives and the layers that use them.

Modules:
  dims            the degrees of parallelism, checked against the world size
  groups          the layout as one object, every axis named by use
  collectives     small device-agnostic collectives over an explicit group
  mappings        autograd functions into and out of tensor/sequence-parallel regions
  layers          vocab-parallel embedding, column- and row-parallel linear
  lora            low-rank adapters beside a TP linear, split as PEFT's Megatron path
  cross_entropy   cross-entropy over TP-split logits
  random          TP-aware random number generation
  ring_attention  context parallelism's attention ring
  fp8             FP8 matrix multiplies on torchao's casts
"""
