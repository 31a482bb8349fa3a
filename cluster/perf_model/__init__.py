"""How long one engine step takes, as a function of its batch (no Ray).

One interface, `StepTimeModel.step_time(StepShape)`, three sources:
- `LinearStepModel`: fitted to measured steps (`pdserve profile`);
- `RooflineStepModel`: from the model's byte and FLOP counts and a GPU's
  datasheet rates times stated efficiencies (planning without the hardware);
- `OnlineCorrection`: wraps either and rescales it by what a live worker
  measures, step by step.
The simulator and the planner read only the interface.
"""

from cluster.perf_model.linear_model import LinearStepModel
from cluster.perf_model.online import OnlineCorrection
from cluster.perf_model.roofline import GPU_SPECS, RooflineStepModel
from cluster.perf_model.step_shape import StepShape, StepTimeModel, load_step_model

__all__ = ["GPU_SPECS", "LinearStepModel", "OnlineCorrection", "RooflineStepModel", "StepShape",
           "StepTimeModel", "load_step_model"]
