"""asyncio actor runtime on the ZeroMQ transport. Knows nothing of models or RL."""
from actors.actor import Actor, ActorServer, concurrent
from actors.directory import Directory, UnknownActor
from actors.errors import ActorDied, ActorError, ActorTimeout, ProtocolError, RemoteError
from actors.interface import ActorCallError, ActorInterface
from actors.loop import run_event_loop
from actors.proxy import ActorProxy
from actors.ref import ActorRef, close_connections
from actors.spawn import ActorSpec, Supervisor, import_callable, import_object, serve_actor

__all__ = [
    "Actor", "ActorServer", "concurrent", "Directory", "UnknownActor", "ActorDied", "ActorError",
    "ActorTimeout", "ProtocolError", "RemoteError", "run_event_loop", "ActorRef",
    "close_connections", "ActorCallError", "ActorInterface", "ActorProxy", "ActorSpec", "Supervisor", "import_callable", "import_object", "serve_actor",
]
