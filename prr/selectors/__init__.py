from prr.selectors.base import Selection, Selector
from prr.selectors.dense import DenseSelector
from prr.selectors.exact import ExactSelector
from prr.selectors.quest import QuestSelector

__all__ = ["Selection", "Selector", "DenseSelector", "ExactSelector", "QuestSelector"]
