"""expresslane's vLLM V1 KV connector (prefill side). Load it with
``"kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector"``."""

from expresslane.engine.connector.connector import ExpressLaneConnector
from expresslane.engine.connector.metadata import Claim, ExpressLaneConnectorMetadata, ShipRequest

__all__ = ["Claim", "ExpressLaneConnector", "ExpressLaneConnectorMetadata", "ShipRequest"]
