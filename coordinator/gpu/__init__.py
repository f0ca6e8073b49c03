"""What knows CUDA. For now its kernels' sources (kernels/: a .cu file a module and the header they share);
the Python that launches them lives in coordinator/device/ and coordinator/model/device_ops.py until the
rest moves here."""
