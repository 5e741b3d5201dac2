"""asyncio actor runtime on the ZeroMQ transport. Knows nothing of models or RL."""
from replayrl.actors.actor import Actor, ActorServer, concurrent
from replayrl.actors.directory import Directory
from replayrl.actors.driver import DRIVER, DriverActors
from replayrl.actors.errors import (
    ActorCallError,
    ActorDied,
    ActorError,
    ActorTimeout,
    ProtocolError,
    RemoteError,
    UnknownActor,
)
from replayrl.actors.interface import ActorInterface
from replayrl.actors.loop import run_event_loop
from replayrl.actors.objects import import_callable, import_object
from replayrl.actors.proxy import ActorProxy
from replayrl.actors.ref import ActorRef, close_connections, send_buffer
from replayrl.actors.serve import serve_actor, serve_actors
from replayrl.actors.spec import ActorSpec, process_groups
from replayrl.actors.supervisor import Supervisor

__all__ = [
    "Actor", "ActorServer", "concurrent", "Directory", "UnknownActor", "ActorDied", "ActorError",
    "ActorTimeout", "ProtocolError", "RemoteError", "run_event_loop", "ActorRef",
    "close_connections", "send_buffer", "ActorCallError", "ActorInterface", "ActorProxy", "ActorSpec", "Supervisor",
    "DRIVER", "DriverActors", "import_callable", "import_object", "serve_actor", "serve_actors", "process_groups",
]
