// Reads and writes NumPy .npy files, so tools can load reference tensors saved with np.save and
// write results that np.load reads back.
//
// Format versions 1.0, 2.0 and 3.0; little-endian fp32, fp16, fp64 and int64 in C order. This is
// not a general NumPy reader: no Fortran order, big-endian, structured or object dtypes, no .npz
// archives and no memory mapping; readNpy reads the data whole, NpyReader a part at a time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backends/dtype.h"
#include "tools/lib/host_tensor.h"

namespace tpsim::tools {

// One array as stored in a .npy file.
struct NpyArray {
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;  // () is a scalar with one element
  std::vector<char> data;           // row-major, little-endian, dtypeSize(dtype) bytes per element
};

// Reads the array in `path`. Accepts descr '<f4' (kFloat32), '<f2' (kFloat16, raw half bits),
// '<f8' (kFloat64) and '<i8' (kInt64); '|' or '=' in place of '<' where they mean little-endian
// on this machine. Throws InvalidArgument naming the file for anything else.
NpyArray readNpy(const std::string& path);
// readNpy's dtype and shape, with the same checks of the header and the file size, but no data
// read (`data` stays empty): what a caller needs to size the work before reading it.
NpyArray readNpyHeader(const std::string& path);

// readNpy a part at a time: the file opened and its header and size checked as readNpy checks them,
// then its elements read in order by as many reads as the caller wants.
class NpyReader {
 public:
  explicit NpyReader(const std::string& path);
  ~NpyReader();
  NpyReader(NpyReader&&) noexcept;
  DType dtype() const;
  const std::vector<std::int64_t>& shape() const;
  std::int64_t numel() const;
  // The next `count` elements, dtypeSize(dtype()) bytes each, into `out`. Throws InvalidArgument
  // naming the file when it holds fewer than that now (it shrank since it was opened).
  void read(std::int64_t count, char* out);
  // Moves past the next `count` elements without reading them.
  void skip(std::int64_t count);

 private:
  struct Open;
  std::unique_ptr<Open> open_;
};

// The array at `data` (row-major, `dtype` as NpyArray holds it) as a StoredTensor of dtype `want`:
// int64 token ids stay int64, float32, float64 and float16 values are rounded to `want`
// (convertElements): what the Python module makes of its arrays, as --load converts its files a
// piece at a time. Throws InvalidArgument starting with `where` when ids are expected and values
// given, or the other way round.
StoredTensor storedTensorOf(DType dtype, const std::vector<std::int64_t>& shape, const void* data, DType want,
                            const std::string& where);
// storedTensorOf's check alone: int64 token ids where `want` is int64, float values elsewhere.
void checkIdsOrValues(DType dtype, DType want, const std::string& where);

// Writes `data` (row-major, little-endian, one element per index of `shape`) to `path` byte for
// byte as numpy.save does: version 1.0, or 2.0 if the header would exceed 65535 bytes. bf16 has
// no NumPy dtype and is rejected. Throws InvalidArgument naming the path if it cannot be written.
void writeNpy(const std::string& path, DType dtype, const std::vector<std::int64_t>& shape,
              const void* data);
// The same to an open file (an OutputFiles temporary); messages start with `where`.
void writeNpy(std::FILE* file, const std::string& where, DType dtype, const std::vector<std::int64_t>& shape,
              const void* data);


}  // namespace tpsim::tools
