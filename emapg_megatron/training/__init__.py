"""Megatron training machinery shared by the trainer, the tests and the tools."""
