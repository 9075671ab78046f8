"""The API's operations, transport-neutral: inputs, validation, the engine call, the result shape.

Used by the HTTP server (``opencoti.server``: routes) and by the client's in-process transport
(``opencoti.client``), so both behave the same:

* ``table``: every non-streaming operation (``OPERATIONS``, ``call``);
* ``generation``: generation requests (``sampling_params``, ``prepare_*``, ``ChatTurn``, answer shapes);
* ``schemas`` / ``results``: the inputs and the typed results;
* ``context``: the engine plus serving settings an operation runs against.
"""

from .context import Context
from .table import OPERATIONS, Operation, call

__all__ = ["Context", "OPERATIONS", "Operation", "call"]
