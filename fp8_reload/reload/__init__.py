"""`load_model` and `update_weights_from_disk`: a reload is a transaction.

    filters      EPLB's weight-name filters, reload units, the model's expected layout
    plan         open and check the checkpoint, select tensors, read and validate them
    backup       copies of what commit may change, and the rollback
    transaction  the entry points: plan -> stage -> backup -> commit -> post-process
"""

from .backup import BACKUP_PLACES, device_memory_bound
from .filters import NameFilter, eplb_filter, generate_weight_name_filter
from .plan import changed_since_read
from .transaction import ReloadReport, load_model, update_weights_from_disk

__all__ = ["BACKUP_PLACES", "NameFilter", "ReloadReport", "changed_since_read", "device_memory_bound",
           "eplb_filter", "generate_weight_name_filter", "load_model", "update_weights_from_disk"]
