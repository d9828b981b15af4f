"""The one error a brief can raise, and its messages (shared by code and tests).

Every message names the field in dotted form (`demand.users`) so the author of a
brief knows exactly which line to change.
"""

from __future__ import annotations

MISSING_FIELD = "brief field {field!r} is missing"
NOT_A_MAPPING = "brief field {field!r} must be a mapping of fields, got {value!r}"
NOT_A_NUMBER = "brief field {field!r} must be a number, got {value!r}"
NOT_POSITIVE = "brief field {field!r} must be greater than zero, got {value!r}"
TOO_LARGE = "brief field {field!r} must be at most {maximum:g}, got {value!r}"
NEGATIVE = "brief field {field!r} must not be negative, got {value!r}"
NOT_A_FRACTION = "brief field {field!r} must be a fraction in [0, 1), got {value!r}"
NOT_AN_INTEGER = "brief field {field!r} must be a whole number, got {value!r}"
NOT_TEXT = "brief field {field!r} must be text, got {value!r}"
NOT_A_BOOL = "brief field {field!r} must be true or false, got {value!r}"
UNKNOWN_FIELD = "brief field {field!r} is not a known field; known here: {known}"
UNKNOWN_CHOICE = "brief field {field!r} must be one of {known}, got {value!r}"
UNKNOWN_MODEL_PRESET = "brief field {field!r}: unknown model preset {value!r}; known: {known}"
UNKNOWN_HARDWARE_PRESET = "brief field {field!r}: unknown hardware preset {value!r}; known: {known}"
UNKNOWN_PRECISION = "brief field {field!r}: unknown precision {value!r}; known: {known}"
NO_COMPUTE_DTYPE = "brief field {field!r}: {hardware} has no {value!r} tensor cores; it has: {known}"
PRESET_OR_SHAPE = "brief field {field!r} needs either 'preset' or the shape fields ({known}), not both"
DUTY_OR_READ_TIME = ("brief field {field!r} needs either 'duty_cycle' with 'turn_period_s', "
                     "or 'read_and_type_s' (one request per answer plus read-and-type time)")
TP_NOT_A_DIVISOR = ("brief field {field!r}: tensor-parallel degree {value} must divide the "
                    "{gpus_per_node} GPUs of a node (one NVSwitch domain)")
TP_TOO_SMALL = ("brief field {field!r}: at TP {value} the weights ({weights_gb:.1f} GB per GPU) and the "
                "activation reserve leave no room for KV in the {usable_gb:.0f} GB the engine may use of a "
                "{hbm_gb:.0f} GB GPU; the smallest TP that fits is {min_tp}")
TP_SPLITS_HEADS = ("brief field {field!r}: tensor-parallel degree {value} must divide the model's "
                   "{heads} attention heads, and its {kv_heads} KV heads must divide evenly over the GPUs "
                   "(or be replicated a whole number of times); TP degrees that do: {known}")
KV_HEADS_ABOVE_HEADS = ("brief field {field!r}: {value} KV heads must be at most the {heads} attention heads "
                        "and divide them (grouped-query attention)")
PRECISION_NOT_ON_GPU = ("brief field {field!r}: {hardware} has no {value} support (no {value} tensor cores); "
                        "precisions it runs: {known}")
TURN_SHORTER_THAN_ANSWER = ("brief field {field!r}: a turn of {value:g} s is not longer than the answer it "
                            "contains ({answer:.3g} s = {tokens:,.0f} output tokens at {rate:.3g} tok/s); "
                            "a user cannot ask again before the answer ends")
YAML_SYNTAX = "brief is not valid YAML: {detail}"
NOT_A_BRIEF = "brief must be a mapping of sections (name, model, hardware, ...), got {value!r}"
MODEL_FITS_NO_GPU_COUNT = ("brief field {field!r}: {model} at {precision} weights ({weights_gb:.1f} GB) "
                           "fits no tensor-parallel group inside one node of {gpus_per_node} × {hardware} "
                           "({usable_gb:.0f} GB usable each at memory fraction {fraction}, "
                           "{reserve_gb:.0f} GB activation reserve): even at TP {gpus_per_node} each GPU "
                           "would hold {per_gpu_gb:.1f} GB of weights; the smallest configuration that fits "
                           "is {smallest}")
BUDGET_NOT_A_MULTIPLE = ("brief field {field!r}: a budget of {value} GPUs is not a whole number of "
                         "TP-{tp} replicas")
BUDGET_BELOW_ONE_REPLICA = ("brief field {field!r}: a budget of {value} GPUs is less than one TP-{tp} "
                            "replica")
P95_BELOW_MEAN = "brief field {field!r}: p95 {value} is below the mean {mean}"
UNKNOWN_REFERENCE_FIGURE = ("brief field {field!r}: no plan figure is called {value!r}; "
                            "known figures: {known}")


class BriefError(ValueError):
    """A brief that cannot be planned: the message says which field and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
