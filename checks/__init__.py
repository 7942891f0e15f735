"""Correctness checks beyond the unit tests, and the harness they share with the tests: the combination sweep
(`combinations`: every pair of layouts and features against one rank), the GPU check's CUDA-only paths
(`gpu_paths`), the host-read recorder that stands in for CUDA's synchronisation count on CPU (`host_reads`,
`moe_dispatch`), and the warm gloo rank pool and launch helpers (`rank_pool`, `launch_helpers`). tests/ and
benchmarks/ import from here; neither imports the other."""
