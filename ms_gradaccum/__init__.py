"""Gradient accumulation for MindSpore that trains the full-batch update on micro-batch memory."""
from ms_gradaccum import _mindspore  # noqa: F401  (first: refuses a MindSpore outside the supported range)
from ms_gradaccum.cells.grad_accumulation import GradAccumulationCell as GradAccumulationCell
from ms_gradaccum.cells.equivalence import EquivalenceReport as EquivalenceReport
from ms_gradaccum.cells.equivalence import check_equivalence as check_equivalence
from ms_gradaccum.core.kinds import IgnoredLabelMean as IgnoredLabelMean
from ms_gradaccum.core.kinds import LossKind as LossKind
from ms_gradaccum.core.kinds import RowMean as RowMean
from ms_gradaccum.core.kinds import RowSum as RowSum
from ms_gradaccum.core.kinds import TokenMean as TokenMean
from ms_gradaccum._mindspore.patches import remove_patches as remove_patches
from ms_gradaccum.cells.scheduler import GradAccumulationScheduler as GradAccumulationScheduler
from ms_gradaccum.cells.accumulating import AccumulatingTrainOneStepCell as AccumulatingTrainOneStepCell
from ms_gradaccum.core.token_sum import token_sum_loss as token_sum_loss
from ms_gradaccum.diagnostics.loss_contract import LossContractReport as LossContractReport
from ms_gradaccum.diagnostics.loss_contract import check_loss_contract as check_loss_contract

__version__ = "0.3.0"

__all__ = ["AccumulatingTrainOneStepCell", "EquivalenceReport", "GradAccumulationCell", "GradAccumulationScheduler",
           "IgnoredLabelMean", "LossContractReport", "LossKind", "RowMean", "RowSum", "TokenMean", "__version__",
           "check_equivalence", "check_loss_contract", "remove_patches", "token_sum_loss"]
