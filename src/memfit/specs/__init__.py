"""What is being run: workloads, bundled model configs, and the GPU catalog."""
