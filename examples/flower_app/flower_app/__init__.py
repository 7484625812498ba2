"""flower_app: fedopt_kernels' FedNAR clients and fused server optimizers in a Flower app."""
