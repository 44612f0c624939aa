"""The methods, one LightningModule each, on the shared :class:`OnPolicyModule` base."""

from lopd_lightning.modules.base import OnPolicyModule
from lopd_lightning.modules.lopd import LOPDModule
from lopd_lightning.modules.sft import SFTModule

__all__ = ["LOPDModule", "OnPolicyModule", "SFTModule"]
