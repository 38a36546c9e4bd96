"""Rules beyond Chameleon's Algorithm 1, one module each, all behind `BatchRule` (base.py).

- memory_hold: a request whose adapter cannot fit gets the memory that frees next;
- slot_squash: a request about to miss its SLO for an adapter slot gets one (an adapter retracted);
- promotion: a queue whose head keeps missing the batch budget goes first.
Not here: the algorithm (multiqueue.py) or its own bypass and squash (bypass.py).
"""

from sgl_multilora.sched.rules.base import BatchRule
from sgl_multilora.sched.rules.memory_hold import MemoryHold
from sgl_multilora.sched.rules.promotion import BudgetPromotion
from sgl_multilora.sched.rules.slot_squash import SlotSquash, SlotSquashRule, choose_slot_squash

__all__ = ["BatchRule", "BudgetPromotion", "MemoryHold", "SlotSquash", "SlotSquashRule",
           "choose_slot_squash"]
