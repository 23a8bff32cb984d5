"""expresslane's vLLM V1 KV connector (prefill side). Load it with
``"kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector"``."""

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from expresslane.engine.connector.connector import ExpressLaneConnector
from expresslane.engine.connector.metadata import Claim, ExpressLaneConnectorMetadata, ShipRequest

__all__ = ["Claim", "ExpressLaneConnector", "ExpressLaneConnectorMetadata", "ShipRequest"]

# MultiConnector rebuilds its children's stats in the API server by class name
# (KVConnectorFactory.get_connector_class_by_name), which knows only registered connectors: register ours
# when vLLM imports this module through kv_connector_module_path (it does so in the API server too, when
# it builds the Prometheus metrics).
try:
    KVConnectorFactory.register_connector("ExpressLaneConnector", __name__, "ExpressLaneConnector")
except ValueError:
    pass  # already registered (imported twice)
