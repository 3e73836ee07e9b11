"""The standard residual connection: every sublayer adds its output to one running sum."""

from torch import Tensor

from mhar_lightning.residual.base import Residual, Stream, register_residual


@register_residual("sum")
class SumResidual(Residual):
    """h_{l+1} = h_l + y_l (the ordinary pre-norm transformer)."""

    def read(self, stream: Stream, l: int) -> Tensor:
        return stream[0]

    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        return (stream[0] + y,)
