"""Ray single controller: start Ray, reserve resources, and drive one worker process per device.

The only package that imports Ray at module level; config, data, algorithms and protocol never import it.
"""

from mmrl.single_controller.resource_pool import (
    DEFAULT_WORKER_ENV_VARS,
    ResourcePool,
    ResourcePoolError,
    alive_node_resources,
    init_ray,
    nodes_that_fit,
)
from mmrl.single_controller.transfer import TransferCounter, put_media
from mmrl.single_controller.worker_group import (
    RayWorkerGroup,
    WorkerGroupError,
    distributed_env,
    merge_dp_outputs,
    method_name,
)

__all__ = [
    "DEFAULT_WORKER_ENV_VARS",
    "RayWorkerGroup",
    "ResourcePool",
    "ResourcePoolError",
    "TransferCounter",
    "WorkerGroupError",
    "alive_node_resources",
    "distributed_env",
    "init_ray",
    "merge_dp_outputs",
    "method_name",
    "nodes_that_fit",
    "put_media",
]
