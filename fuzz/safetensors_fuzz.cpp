// One safetensors file, as a model directory would hold it: the header is read and validated
// (io/safetensors.h), then every tensor it accepts is viewed, materialised under the identity
// load plan and converted, which touches each byte its data_offsets claim.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_support.h"
#include "io/safetensors.h"
#include "model/load_plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto file = kiln::fuzz::ScratchDirectory::instance().write("model.safetensors", kiln::fuzz::as_text(data, size));
  try {
    const kiln::Checkpoint checkpoint = kiln::Checkpoint::open_files({file});
    for (const auto& [name, info] : checkpoint.tensors()) {
      const kiln::Tensor view = checkpoint.view(name);
      // The first and last stored bytes: ASan reports a view that points outside the mapping.
      if (view.nbytes() > 0) {
        const auto* bytes = static_cast<const volatile uint8_t*>(view.raw());
        (void)bytes[0];
        (void)bytes[view.nbytes() - 1];
      }
    }
    kiln::WeightMap weights(checkpoint, kiln::identity_plan(checkpoint));
    weights.convert_to(kiln::DType::F32);
  } catch (const kiln::Error&) {
    // A rejected file is the expected outcome; any other exception or a crash is a finding.
  }
  return 0;
}
