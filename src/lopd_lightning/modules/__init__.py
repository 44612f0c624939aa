"""The methods, one LightningModule each, on the shared :class:`OnPolicyModule` base (SDPO and OPSD on
its :class:`SelfDistillationModule` refinement)."""

from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.modules.grpo import GRPOModule
from lopd_lightning.modules.lopd import LOPDModule
from lopd_lightning.modules.opsd import OPSDModule
from lopd_lightning.modules.sdpo import SDPOModule
from lopd_lightning.modules.self_distillation import SelfDistillationModule
from lopd_lightning.modules.sft import SFTModule
from lopd_lightning.modules.skill_sd import SkillSDModule

__all__ = [
    "GRPOModule",
    "LOPDModule",
    "OPSDModule",
    "OnPolicyModule",
    "SDPOModule",
    "SFTModule",
    "SelfDistillationModule",
    "SkillSDModule",
]
