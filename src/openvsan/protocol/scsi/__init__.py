"""SCSI command set (SPC-4, SBC-4), sans-socket: the iSCSI transport hands CDBs and Data-Out to a
ScsiTarget and gets back status, data-in and sense."""

from openvsan.protocol.scsi.lun import Lun
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.sense import (
                                          BUSY,
                                          CHECK_CONDITION,
                                          CONDITION_MET,
                                          GOOD,
                                          RESERVATION_CONFLICT,
                                          TASK_ABORTED,
                                          TASK_SET_FULL,
                                          ScsiError,
                                          ScsiResult,
                                          block_error_result,
                                          build_sense,
                                          parse_sense,
)
from openvsan.protocol.scsi.target import ScsiTarget

__all__ = [
                                          "BUSY",
                                          "CHECK_CONDITION",
                                          "CONDITION_MET",
                                          "GOOD",
                                          "RESERVATION_CONFLICT",
                                          "TASK_ABORTED",
                                          "TASK_SET_FULL",
                                          "Lun",
                                          "Nexus",
                                          "ScsiError",
                                          "ScsiResult",
                                          "ScsiTarget",
                                          "block_error_result",
                                          "build_sense",
                                          "parse_sense",
]
