"""The Triton kernel tests run compiled on a GPU when there is one, else on CPU tensors under
Triton's interpreter, switched on here before any kernel is defined."""
from pagellm.attention.interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()
