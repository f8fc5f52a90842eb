"""The checkpoint pipelines, in the library: `align_checkpoints` and `merge_checkpoints` take
Hugging Face folders (or Hub ids) or Orbax checkpoints (`io.orbax`: a checkpoint, a run's latest
step, a step folder) and write a folder (Hugging Face, or Orbax with `format="orbax"`) with the
weights, a report, a model card and the recipe, atomically: load → fold → align → statistics → merge → save, in memory or streamed a
chunk of layers at a time (`streaming`), whichever the memory allows. The `rotsym` command line
only parses its arguments into these calls and prints what they return.

Every refusal comes before any weight is read (configs and safetensors headers first), as a
`PipelineError` naming the problem. A dry run checks as much and returns the plan.

The steps live in one module each: `run` (the options, results and output every call shares),
`refusals` (the checks of inputs and OUT), `streamed` (whether and how a run streams), `notes`
(what a run tells the user), `align` and `merge` (the two pipelines, a merge in memory or
streamed). Their public names are imported from here.
"""

from ..io.loading import PipelineError, Progress
from .align import align_checkpoints, align_pair
from .merge import MERGE_INPUTS_GIVEN, aligned, merge_checkpoints, merge_method, model_names
from .notes import note_alignment
from .refusals import check_alignment_data, check_out, check_rotation, same_architecture
from .run import DryRun, RunOptions, Written, align_options_of, aligning_spec, checked, folded, settled_for
from .streamed import unstreamed

__all__ = ["MERGE_INPUTS_GIVEN", "DryRun", "PipelineError", "Progress", "RunOptions", "Written", "align_checkpoints", "align_options_of",
           "align_pair", "aligned", "aligning_spec", "check_alignment_data", "check_out", "check_rotation", "checked", "folded",
           "merge_checkpoints", "merge_method", "model_names", "note_alignment", "same_architecture", "settled_for", "unstreamed"]
