"""Generated protobuf and gRPC code of the Reach contracts (``proto/reach``), one subpackage per
contract version: ``reach.v1``. Shipped with the ``reach-mesh`` distribution; the SDK built on
it is ``reach_mesh``."""
