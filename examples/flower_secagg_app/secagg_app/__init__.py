"""secagg_app: a fused server step under Flower's SecAgg+, in deployment mode."""
