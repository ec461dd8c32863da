from prr.selectors.base import Selection, Selector
from prr.selectors.dense import DenseSelector
from prr.selectors.exact import ExactSelector
from prr.selectors.infllm import InfLLMSelector
from prr.selectors.less import LessSelector
from prr.selectors.quest import QuestSelector

__all__ = ["Selection", "Selector", "DenseSelector", "ExactSelector", "InfLLMSelector", "LessSelector", "QuestSelector"]
