"""Helpers shared by the higher layers (server optimizers, FedLAW, simulator)."""

from .flat import (FlatLayout, TensorSlot, buffers_layout, buffers_to_vector, flatten_parameters_, module_to_vector,
                   parameters_layout, parameters_to_vector, vector_to_buffers, vector_to_module, vector_to_parameters)

__all__ = [
    "FlatLayout", "TensorSlot", "parameters_layout", "buffers_layout", "module_to_vector", "vector_to_module",
    "parameters_to_vector", "vector_to_parameters", "buffers_to_vector", "vector_to_buffers", "flatten_parameters_",
]
