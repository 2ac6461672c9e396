// A c10d Backend whose collectives are a Python object's: the "dlcp" process group as torch
// registers every other backend (a torch ProcessGroup with a Backend per device), so the group has
// a backend (`_get_backend`), a name, and everything in torch that looks for them works.
//
// Why C++: torch's Python binding of c10d::Backend has no trampoline (only ProcessGroup and Work
// have one, torch/csrc/distributed/c10d/PyProcessGroup.hpp), so a Python subclass of Backend is
// never called. This class is the trampoline: each collective takes the interpreter lock, calls
// the method of the same meaning on the Python object (dlcp_torch.backend.DLCPProcessGroup: its
// names are ProcessGroup's Python ones) and returns the Work it returned, held with its Python
// object alive (as PyProcessGroup::PyWorkHolder does).
//
// Compiled on first use against the torch that runs it (dlcp_torch/c10d_backend.py): a torch
// extension must match torch's C++ ABI exactly, which a wheel built without torch cannot.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dlcp {

// A Work the Python object made, with that object kept alive for as long as C++ holds the Work.
// Its wait and get_future are Python overrides, called through torch's PyWork trampoline; the
// trampoline forwards nothing else, so the state a caller polls (is_completed, is_success,
// exception, result) is asked of the Python object here. Without it `work.is_completed()` stayed
// False after the collective had ended (a polling loop never left) and `result()` raised.
class HeldWork : public c10d::Work {
   public:
    explicit HeldWork(py::object work) : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(work)) {}
    ~HeldWork() override {
        py::gil_scoped_acquire gil;  // a Python object is freed under the lock
        py_ = py::object();
    }
    bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }
    bool isCompleted() override { return ask("is_completed").cast<bool>(); }
    bool isSuccess() const override { return ask("is_success").cast<bool>(); }
    std::exception_ptr exception() const override {
        py::gil_scoped_acquire gil;
        py::object exc = py_.attr("exception")();
        if (exc.is_none()) return nullptr;
        // (as a DistBackendError, what gloo's and NCCL's failures are; another error keeps its name)
        std::string kind = py::str(exc.get_type().attr("__name__")).cast<std::string>();
        std::string text = (kind == "DistBackendError" ? "" : kind + ": ") + py::str(exc).cast<std::string>();
        return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, uint32_t(__LINE__)}, text));
    }
    std::vector<at::Tensor> result() override { return ask("result").cast<std::vector<at::Tensor>>(); }

   private:
    py::object ask(const char* method) const {
        py::gil_scoped_acquire gil;
        return py_.attr(method)();
    }

    c10::intrusive_ptr<c10d::Work> work_;
    py::object py_;
};

class ForwardingBackend final : public c10d::Backend {
   public:
    ForwardingBackend(int rank, int size, py::object impl) : Backend(rank, size), impl_(std::move(impl)) {}
    ~ForwardingBackend() override {
        py::gil_scoped_acquire gil;
        impl_ = py::object();
    }

    py::object impl() const { return impl_; }
    const std::string getBackendName() const override { return "dlcp"; }

    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
        return call("broadcast", tensors, opts);
    }
    c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override {
        return call("allreduce", tensors, opts);
    }
    c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceCoalescedOptions& opts) override {
        return call("allreduce_coalesced", tensors, opts);
    }
    c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
        return call("reduce", tensors, opts);
    }
    c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions& opts) override {
        return call("allgather", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
        return call("all_gather_single", output, input, opts);
    }
    c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::AllgatherOptions& opts) override {
        return call("all_gather_single_coalesced", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::GatherOptions& opts) override {
        return call("gather", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                           std::vector<std::vector<at::Tensor>>& inputs,
                                           const c10d::ScatterOptions& opts) override {
        return call("scatter", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ReduceScatterOptions& opts) override {
        return call("reduce_scatter", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::ReduceScatterOptions& opts) override {
        return call("reduce_scatter_single", output, input, opts);
    }
    c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) override {
        return call("reduce_scatter_single_coalesced", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_split_sizes,
                                                 std::vector<int64_t>& input_split_sizes,
                                                 const c10d::AllToAllOptions& opts) override {
        return call("all_to_all_single", output, input, output_split_sizes, input_split_sizes, opts);
    }
    c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                            const c10d::AllToAllOptions& opts) override {
        return call("alltoall", outputs, inputs, opts);
    }
    c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
        return call("send", tensors, dst, tag);
    }
    c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
        return call("recv", tensors, src, tag);
    }
    c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
        return call("recv_anysource", tensors, tag);
    }
    c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
        return call("barrier", opts);
    }
    void shutdown() override { call_void("shutdown"); }
    void abort() override { call_void("abort"); }

   private:
    template <typename... Args>
    c10::intrusive_ptr<c10d::Work> call(const char* name, Args&&... args) {
        // (a Python exception comes back as py::error_already_set: the caller sees it as raised)
        py::gil_scoped_acquire gil;
        py::object work = impl_.attr(name)(std::forward<Args>(args)...);
        return c10::make_intrusive<HeldWork>(std::move(work));
    }
    void call_void(const char* name) {
        py::gil_scoped_acquire gil;
        if (impl_ && py::hasattr(impl_, name)) impl_.attr(name)();
    }

    py::object impl_;
};

}  // namespace dlcp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dlcp's c10d Backend: collectives forwarded to a Python process group object";
    // (Backend is torch's own binding, found through pybind11's shared registry)
    py::class_<dlcp::ForwardingBackend, c10d::Backend, c10::intrusive_ptr<dlcp::ForwardingBackend>>(
        m, "ForwardingBackend")
        .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"))
        .def_property_readonly("impl", &dlcp::ForwardingBackend::impl,
                               "the Python object whose collectives this backend runs");
}
