// Point-to-point traffic between pipeline stages, in the manner of Megatron-Core's
// p2p_communication: the message format, the tags, each plan slot's sends and receives posted as
// one batched call, the receive buffers, and error context naming the stage, micro-batch and peer.
//
// Messages. Each activation or gradient message is a header (int64[kHeaderLength]: a magic number,
// the producing stage, the micro-batch, the tensor count, each tensor's dtype and shape) and then
// the tensors. Their shapes are known on both sides before the first step (the shape pass,
// parallel/pipeline/shape_pass.h), and tensors that cross a stage boundary keep those shapes (a
// sender whose outputs change shape stops with an error naming the stage, micro-batch and both
// shapes; Megatron-LM's fixed tensor_shape is the same rule). So every receive is posted with its
// buffers (reused, per stage and shape, once nothing holds them) where the plan lists it.
//
// Batches. The sends and receives of one plan slot (a run of communication ops between two compute
// ops) go out as batch_isend_irecv calls: on NCCL each one ncclGroupStart/End on the
// communicator's stream, Megatron-Core's send_forward_recv_backward pattern, so two neighbours
// that send to each other at once never wait on each other's buffering. A slot is cut into several
// batches where its messages with one peer sit in different batches of that peer (comm_batches(),
// parallel/pipeline/schedule_check.h). On an ordered transport (NCCL) a batch holds both
// directions and every message has one tag (check_posting_order() proves both ends post each
// pair's messages in one order); otherwise the receives go apart, so that waiting for them never
// waits for this rank's own sends to be taken, and each tensor has its own tag. A receive is
// completed right before the compute op that consumes it (on a device: the compute stream waits for
// it, the host does not); sends at the end of the step. The receiver checks each header against
// the plan (on a device at the end of the step, in one copy): a stage or micro-batch mismatch is an
// error naming both stages (Megatron-LM PR #5271: a silent swap trained on the wrong activations).
// Deadlines are the communicator's: every wait runs under its timeout (parallel.timeout_s), and a
// TimeoutError or CommError gets the batch's context here.
//
// Thread-safety: one training thread. Errors: parallax::Error / CommError / TimeoutError naming
// the stage, pipeline rank, micro-batch and peer.
#pragma once

#include "comm/communicator.h"
#include "parallel/pipeline/schedule.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace parallax::parallel::pipeline {

constexpr int64_t kHeaderMagic = 0x50504C58;  // "PPLX"
constexpr int64_t kHeaderLength = 64;
constexpr int kMaxMessageTensors = 7;  // 4 + 8 * 7 < kHeaderLength
constexpr int kMaxMessageDims = 6;

// The dtype and shape of one tensor of a message.
struct TensorMeta {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  bool operator==(const TensorMeta& o) const { return dtype == o.dtype && shape == o.shape; }
};
// The dtype and shape of each tensor of a message.
using MessageShape = std::vector<TensorMeta>;

// The header of a message of `shape` from `stage` for micro-batch `micro` (int64[kHeaderLength],
// CPU).
at::Tensor make_header(int stage, int micro, const MessageShape& shape);
// A header as received (`host`: int64[kHeaderLength] on the CPU). `valid`: the magic number and a
// tensor count in [1, kMaxMessageTensors]; `shape` is read only then.
struct Header {
  bool valid = false;
  int64_t stage = -1, micro = -1;
  MessageShape shape;
};
Header read_header(const at::Tensor& host);
// "Float [2, 3], Long [4]".
std::string shape_string(const MessageShape& shape);
// Whether a communication op moves activations (else gradients).
bool is_act(const Op& op);
// "the activations of micro-batch 3".
std::string message_name(const Op& op);

// This pipeline rank's messages of one plan, step after step.
class P2pMessenger {
 public:
  // The tensors a send op moves, in any device or layout (the messenger copies them to the
  // communication device, contiguous and detached).
  using Payload = std::function<std::vector<at::Tensor>(const Op& send)>;

  // `pp`: the pipeline group; `schedule`: a checked plan (copied); `ordered`: the transport matches
  // messages by order (NCCL; PipelineOptions::ordered_p2p). Error: parallax::Error from
  // check_posting_order() on an ordered transport; ConfigError naming parallel.pp and
  // train.grad_accum when a step's messages are more than the tags can name.
  P2pMessenger(comm::CommPtr pp, const Schedule& schedule, bool ordered);

  // NCCL connects a pair of ranks per direction, lazily, inside the ncclGroupEnd of the first
  // batch that uses the direction, and that setup blocks until the peer sets up its end; so every
  // pair of neighbours exchanges one element both ways in one batch, on `device`, before the first
  // step (p2p.cpp says why). Collective over this rank's plan peers.
  void connect_peers(c10::Device device);

  // The activations' shapes of each stage boundary this rank sends or receives (the shape pass);
  // the gradients' follow: the gradient of stage s's inputs goes back as stage s - 1's outputs,
  // floating ones in their dtype and shape, the others as empty float placeholders.
  void set_activation_shapes(const std::map<int, MessageShape>& act);
  bool shapes_known() const { return shapes_known_; }

  // Opens a step: buffers on `comm_device`, received tensors handed over on `model_device`.
  void begin_step(c10::Device comm_device, c10::Device model_device);
  // The end of the batch of plan ops that starts at op `first` of this rank (comm_batches()).
  std::size_t batch_end(std::size_t first) const { return batch_end_.at(first); }
  // Posts this rank's plan ops [first, end) as one batch; `payload` gives each send's tensors.
  // Error: a payload whose shapes differ from the shape pass's, naming the stage and both shapes.
  void post(std::size_t first, std::size_t end, const Payload& payload);
  // Completes the receive of the activations (act) or gradients produced by `stage` for
  // micro-batch `micro`, for the compute op `pass` ("F" or "B"): its tensors on the model device.
  std::vector<at::Tensor> receive(bool act, int micro, int stage, const char* pass);
  // Closes the step: waits for every send, checks the headers not yet checked. Error: a
  // received message no compute op consumed, a header that does not match the plan.
  void end_step();

 private:
  struct Message {
    const Op* op;
    at::Tensor header;
    std::vector<at::Tensor> tensors;
    int64_t bytes = 0;
  };
  struct Batch {
    std::vector<Message> messages;
    comm::WorkPtr sends, recvs;
    bool received = false;
  };
  int tag(const Op& op, int k) const;
  const MessageShape& shape_of(const Op& op) const;
  at::Tensor to_comm(const at::Tensor& t) const;
  // A receive buffer of `meta` on the communication device, reused once nothing else holds it.
  at::Tensor buffer(const std::string& pool, const TensorMeta& meta);
  // Checks that a payload has the shapes of the shape pass.
  void check_payload(const Op& c, const std::vector<at::Tensor>& payload) const;
  void check_header(const at::Tensor& got, const Op& c) const;
  // "sending the gradients of micro-batch 3 to stage 0 (pipeline rank 0, 16384 bytes); ...".
  std::string batch_text(const Batch& b) const;
  // The context of a failed batch, named from this rank's side.
  std::string batch_context(const Batch& b, const char* when) const;

  comm::CommPtr pp_;
  Schedule schedule_;
  bool ordered_;
  bool on_device_;
  std::map<std::size_t, std::size_t> batch_end_;  // comm_batches(): first op -> end
  std::map<int, MessageShape> act_shape_;         // producing stage -> its outputs
  std::map<int, MessageShape> grad_shape_;        // producing stage -> the gradients of its inputs
  bool shapes_known_ = false;
  std::map<std::string, std::vector<at::Tensor>> pool_;
  c10::Device comm_target_{c10::kCPU};
  c10::Device model_device_{c10::kCPU};
  // The step's batches, the receives posted and not yet consumed ((act 0 / grad 1, micro, stage)
  // -> (batch, message)), and on a device the headers to check at the end.
  std::vector<Batch> batches_;
  std::map<std::tuple<int, int, int>, std::pair<std::size_t, std::size_t>> incoming_;
  std::vector<std::pair<at::Tensor, const Op*>> unchecked_;
};

}  // namespace parallax::parallel::pipeline
