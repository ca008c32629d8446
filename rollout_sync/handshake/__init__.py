"""The ZeroMQ handshake: peers introduce themselves and their maps, the coordinator assigns global ranks and
hands out plan halves and the sync group's address. Metadata only; nothing is pickled."""

from .coordinator import ROLLOUT, TRAINER, Coordinator, PeerInfo
from .messages import PROTOCOL, VERSION, Message
from .peer import Peer

__all__ = ["PROTOCOL", "ROLLOUT", "TRAINER", "VERSION", "Coordinator", "Message", "Peer", "PeerInfo"]
